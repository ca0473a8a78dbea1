"""Training-run folders: a folder of saved steps (torchtitan ``step-N/``, torch_checkpointing
``step_N/``, Megatron ``iter_NNNNNNN/`` with ``latest_checkpointed_iteration.txt``, Hugging
Face Trainer ``checkpoint-N/``, DeepSpeed ``global_stepN/`` with its ``latest`` tag file)
opens as its latest step, and says which it chose and which others exist (the source's
``steps``).

The latest is the one Megatron's tracker or DeepSpeed's tag file names, else the highest
number. A step whose save did not finish is passed over for the one before it (noted);
torch_checkpointing's uncommitted ``tmp_<name>/`` folders are never chosen.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from inspector.errors import CheckpointFileMissingError, CorruptCheckpointError, UnfinishedSaveError
from inspector.formats.base import Source, Step
from inspector.formats.deepspeed.files import TAG_FILE
from inspector.storage.base import Storage

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
STEP_DIRS = {
    "torchtitan": re.compile(r"step-([0-9]+)"),
    "torch_checkpointing": re.compile(r"step_([0-9]+)"),
    "Megatron": re.compile(r"iter_([0-9]+)"),
    "Hugging Face Trainer": re.compile(r"checkpoint-([0-9]+)"),
    "DeepSpeed": re.compile(r"global_step([0-9]+)"),
}
UNCOMMITTED = "tmp_"
_MAX_TRACKER_BYTES = 64
# Files that make the folder a checkpoint of its own (a Trainer's output folder holds the
# final model beside its checkpoint-N/ steps).
_CHECKPOINT_FILES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".index.json", ".distcp")

Opener = Callable[[Storage], Source]


def open_run(storage: Storage, open_step: Opener, open_here: Opener) -> Source | None:
    """The run's latest step opened with ``open_step`` (or the folder itself with
    ``open_here`` when it also holds checkpoint files), its ``steps`` set; None when the
    folder holds no steps."""
    listed = storage.list()
    dirs = [name for name, kind in listed if kind == "dir"]
    steps = _steps(dirs)
    pending = [d for d in dirs if d.startswith(UNCOMMITTED) and _steps([d[len(UNCOMMITTED) :]])]
    tracked = (TRACKER, "file") in listed
    tagged = (TAG_FILE, "file") in listed and any(n.startswith("global_step") for n in dirs)
    if not steps and not pending and not tracked and not tagged:
        return None
    notes = [f"ignored {d}/: a save that was never committed" for d in pending]
    files = [name for name, kind in listed if kind == "file" and name.endswith(_CHECKPOINT_FILES)]
    if files:
        source = open_here(storage)
        notes.insert(0, f"the folder also holds {len(steps)} saved step(s): see ck.steps")
        return _attached(source, storage, steps, None, notes)
    if tracked:
        chosen = _tracked(storage, steps)
        notes.insert(0, f"{TRACKER} names {chosen}/ as the latest step")
        return _attached(open_step(storage.child(chosen)), storage, steps, chosen, notes)
    if tagged:
        chosen = _tagged(storage, dirs, steps)
        notes.insert(0, f"{TAG_FILE} names {chosen}/ as the latest step")
        steps = steps if chosen in {s for s, _ in steps} else [*steps, (chosen, None)]
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


def _tracked(storage: Storage, steps: list[tuple[str, int | None]]) -> str:
    """The folder Megatron's tracker names (``iter_%07d`` of its number, or ``release``)."""
    label = storage.describe(TRACKER)
    raw = storage.read(TRACKER, 0, min(storage.size(TRACKER), _MAX_TRACKER_BYTES + 1))
    value = raw.decode("utf-8", "replace").strip()
    if value == RELEASE:
        name = RELEASE
    elif value.isdigit() and len(raw) <= _MAX_TRACKER_BYTES:
        name = f"iter_{int(value):07d}"
    else:
        raise CorruptCheckpointError(
            f"holds {value[:40]!r}, not an iteration number or 'release'", file=label
        )
    if name not in {step for step, _ in steps}:
        others = ", ".join(step for step, _ in steps) or "none"
        raise CheckpointFileMissingError(
            f"names iteration {value!r}, but there is no {name}/ folder (steps found: {others})",
            file=label,
        )
    return name


def _tagged(storage: Storage, dirs: list[str], steps: list[tuple[str, int | None]]) -> str:
    """The folder DeepSpeed's tag file names (any tag; ``global_stepN`` by default)."""
    label = storage.describe(TAG_FILE)
    raw = storage.read(TAG_FILE, 0, min(storage.size(TAG_FILE), _MAX_TRACKER_BYTES + 1))
    tag = raw.decode("utf-8", "replace").strip()
    if not tag or len(raw) > _MAX_TRACKER_BYTES or "/" in tag or tag in (".", ".."):
        raise CorruptCheckpointError(f"holds {tag[:40]!r}, not a step folder's name", file=label)
    if tag not in dirs:
        others = ", ".join(step for step, _ in steps) or "none"
        raise CheckpointFileMissingError(
            f"names the tag {tag!r}, but there is no {tag}/ folder (steps found: {others})",
            file=label,
        )
    return tag


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
        chose = f"opened the latest step, {name}/, of {len(steps)} saved step(s)"
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
