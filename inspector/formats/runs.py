"""Training-run folders: a folder of saved steps (each producer's run-folder rule, from its
profile: torchtitan ``step-N/``, torch_checkpointing ``step_N/``, Megatron ``iter_NNNNNNN/``
with ``latest_checkpointed_iteration.txt``, DeepSpeed ``global_stepN/`` with ``latest``,
Hugging Face Trainer ``checkpoint-N/``, accelerate ``checkpoint_N/``; or a folder of step
files: Lightning's ``*.ckpt``) opens as its latest step, and says which it chose and which
others exist (the source's ``steps``).

The latest is the one a tracker file names, else the highest number. A step whose save
did not finish is passed over for the one before it (noted); torch_checkpointing's
uncommitted ``tmp_<name>/`` folders are never chosen. A step file is numbered from its name,
else from the step counter stored in it; a file that only repeats the newest step
(Lightning's ``last.ckpt``) is noted, not listed.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence

from inspector.errors import (
    CheckpointFileMissingError,
    CorruptCheckpointError,
    InspectorError,
    UnfinishedSaveError,
)
from inspector.formats.base import Source, Step
from inspector.formats.producers import PROFILES, StepFiles
from inspector.storage.base import Storage
from inspector.words import counted

RELEASE = "release"
STEP_DIRS = {p.name: re.compile(p.step_dir) for p in PROFILES if p.step_dir}
TRACKERS = dict(p.tracker for p in PROFILES if p.tracker)  # file -> the folder it names
STEP_FILES = {p.name: p.step_files for p in PROFILES if p.step_files}
UNCOMMITTED = "tmp_"
_MAX_TRACKER_BYTES = 64
# Files that make the folder a checkpoint of its own (a Trainer's output folder holds the
# final model beside its checkpoint-N/ steps).
_CHECKPOINT_FILES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".index.json", ".distcp")

Opener = Callable[[Storage], Source]
FileOpener = Callable[[Storage, str], Source]


def open_run(
    storage: Storage, open_step: Opener, open_here: Opener, open_file: FileOpener
) -> Source | None:
    """The run's latest step opened with ``open_step`` (or the folder itself with
    ``open_here`` when it also holds checkpoint files; a step file with ``open_file``), its
    ``steps`` set; None when the folder holds no steps."""
    listed = storage.list()
    dirs = [name for name, kind in listed if kind == "dir"]
    steps = _steps(dirs)
    pending = [d for d in dirs if d.startswith(UNCOMMITTED) and _steps([d[len(UNCOMMITTED) :]])]
    tracker = next((t for t in TRACKERS if (t, "file") in listed), None)
    if not steps and not pending and tracker is None:
        return _file_run(storage, listed, open_file)
    notes = [f"ignored {d}/: a save that was never committed" for d in pending]
    files = [name for name, kind in listed if kind == "file" and name.endswith(_CHECKPOINT_FILES)]
    if files:
        source = open_here(storage)
        notes.insert(0, f"the folder also holds {counted(len(steps), 'saved step')}: see ck.steps")
        return _attached(source, storage, steps, None, notes)
    if tracker is not None:
        chosen = _tracked(storage, tracker, steps)
        notes.insert(0, f"{tracker} names {chosen}/ as the latest step")
        return _attached(open_step(storage.child(chosen)), storage, steps, chosen, notes)
    if not steps:
        raise UnfinishedSaveError(
            f"the save did not finish: only uncommitted {', '.join(d + '/' for d in pending)} "
            "(written to tmp_<name>/, renamed when every rank is done); open it by path to "
            "inspect what was written",
            file=storage.location,
            found=tuple(pending),
        )
    return _latest(storage, steps, open_step, notes)


def _steps(dirs: list[str]) -> list[tuple[str, int | None]]:
    """Step folders and their numbers, lowest first (Megatron's ``release`` last)."""
    found = [
        (name, int(match.group(1)))
        for name in dirs
        for pattern in STEP_DIRS.values()
        if (match := pattern.fullmatch(name))
    ]
    found.sort(key=lambda step: step[1])
    return [*found, *([(RELEASE, None)] if RELEASE in dirs else [])]


def _file_run(
    storage: Storage, listed: Sequence[tuple[str, str]], open_file: FileOpener
) -> Source | None:
    """The newest step of a folder saved one file per step (a producer's ``step_files``),
    its ``steps`` set; None when the folder is no such run (judged by the files' content)."""
    files = [name for name, kind in listed if kind == "file"]
    for producer, rule in STEP_FILES.items():
        found = sorted(n for n in files if fnmatch.fnmatchcase(n, rule.files))
        run = _StepFiles(storage, producer, rule, open_file).run(found) if len(found) > 1 else None
        if run is not None:
            return run
    return None


class _StepFiles:
    """One producer's step files in a folder, each opened at most once."""

    def __init__(self, storage: Storage, producer: str, rule: StepFiles, opener: FileOpener):
        self.storage, self.producer, self.rule, self.opener = storage, producer, rule, opener
        self.opened: dict[str, Source] = {}
        self.notes: list[str] = []

    def run(self, found: list[str]) -> Source | None:
        """The newest step that opens, the others listed; None when the files are not the
        producer's."""
        last = [n for n in found if re.fullmatch(self.rule.last, n)]
        steps: list[tuple[str, int | None]] = []
        for name in (n for n in found if n not in last):
            match = re.search(self.rule.number, name)
            number = int(match.group(1)) if match else self._counted(name)
            if number is not None:
                steps.append((name, number))
        for name in last:
            number = self._counted(name)
            same = next((step for step, n in steps if n == number), None)
            if same is not None:
                self.notes.append(f"{name} repeats step {number} ({same}): not a step of its own")
            elif number is not None:
                steps.append((name, number))
        steps.sort(key=lambda step: step[1] or 0)
        for newest, _ in reversed(steps):
            source = self._open(newest)
            if source is None:
                continue
            if source.producer != self.producer:
                return None
            chose = f"opened the latest step, {newest}, of {counted(len(steps), 'saved step')}"
            return _attached(source, self.storage, steps, newest, [chose, *self.notes])
        return None

    def _open(self, name: str) -> Source | None:
        """The file opened (once); None, noted, when it does not open."""
        if name not in self.opened:
            try:
                self.opened[name] = self.opener(self.storage, name)
            except InspectorError as exc:
                self.notes.append(f"passed over {name}: {exc}")
                return None
        return self.opened[name]

    def _counted(self, name: str) -> int | None:
        """The step number stored in the file; None (noted) when the file has none."""
        source = self._open(name)
        if source is None:
            return None
        if source.producer != self.producer:
            self.notes.append(f"passed over {name}: not written by {self.producer}")
            return None
        key = self.rule.counter
        entry = next((e for e in source.entries() if e.key == key), None)
        value = source.read_object(entry) if entry is not None and entry.kind == "object" else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        error = CorruptCheckpointError(
            f"holds no step number (a {self.producer} step file keeps it under {key!r}; "
            f"found {'nothing' if entry is None else repr(value)[:40]})",
            file=self.storage.describe(name),
            key=key,
        )
        self.notes.append(f"passed over {name}: {error}")
        return None


def _tracked(storage: Storage, tracker: str, steps: list[tuple[str, int | None]]) -> str:
    """The folder a tracker file names: Megatron's ``iter_%07d`` of its number (or
    ``release``), DeepSpeed's folder name itself."""
    label = storage.describe(tracker)
    raw = storage.read(tracker, 0, min(storage.size(tracker), _MAX_TRACKER_BYTES + 1))
    value = raw.decode("utf-8", "replace").strip()
    template = TRACKERS[tracker]
    numbered = "{:" in template
    if value == RELEASE:
        name = RELEASE
    elif len(raw) <= _MAX_TRACKER_BYTES and (value.isdigit() or not numbered) and value:
        name = template.format(int(value) if numbered else value)
    else:
        what = "an iteration number or 'release'" if numbered else "a step folder's name"
        raise CorruptCheckpointError(f"holds {value[:40]!r}, not {what}", file=label)
    if name not in {step for step, _ in steps}:
        others = ", ".join(step for step, _ in steps) or "none"
        raise CheckpointFileMissingError(
            f"names {'iteration ' if numbered else ''}{value!r}, but there is no {name}/ "
            f"folder (steps found: {others})",
            file=label,
        )
    return name


def _latest(
    storage: Storage, steps: list[tuple[str, int | None]], open_step: Opener, notes: list[str]
) -> Source:
    """The highest-numbered step that opens; unfinished saves after it are noted."""
    skipped = []
    for name, _ in reversed(steps):
        try:
            source = open_step(storage.child(name))
        except UnfinishedSaveError as exc:
            skipped.append(f"passed over {name}/: {exc.reason}")
            continue
        chose = f"opened the latest step, {name}/, of {counted(len(steps), 'saved step')}"
        return _attached(source, storage, steps, name, [chose, *skipped, *notes])
    raise UnfinishedSaveError(
        "no saved step finished: " + "; ".join(skipped),
        file=storage.location,
        found=tuple(name for name, _ in steps),
    )


def _attached(
    source: Source,
    storage: Storage,
    steps: list[tuple[str, int | None]],
    chosen: str | None,
    notes: list[str],
) -> Source:
    """The source with the run's steps and the notes on how the step was chosen (set once,
    while detecting)."""
    source.steps = tuple(
        Step(name, number, storage.describe(name), opened=name == chosen) for name, number in steps
    )
    source.notes = (*notes, *source.notes)
    return source
