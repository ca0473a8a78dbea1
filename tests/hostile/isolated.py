"""One hostile case in a child process of its own, so a segfault, an abort, a hang or a
poisoned module cannot take the test session (or the next case) with it.

``run`` hands the case to a zygote (tests/hostile/zygote.py): a process that imported torch
and the inspector and warmed up on every genuine checkpoint once, and forks a child per
case. The child limits its address space (RLIMIT_AS 3 GiB), then drives the case through
public entry points only, each call a *step* run under the audit-hook guard and a
watchdog, and reports every step as it starts and ends. ``judge`` turns the records, the
exit status and stderr into the outcome and the list of ways the promise was broken
(empty when kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.hostile.zygote import Zygote

STEP_SECONDS = 10  # a step still running then is a hang: the child dumps its stack and exits
SLOW_SECONDS = 5.0  # a step slower than this fails the case (its files are a few MB)
RSS_BYTES = 256 << 20  # resident set growth allowed to a whole case, above the warmed-up child
VM_BYTES = 768 << 20  # address space growth allowed (an untouched 1 GiB tensor costs no RSS)
CHILD_SECONDS = 300  # a whole case; its steps are watched one by one (STEP_SECONDS)
SAMPLES = 4096  # elements compared of a tensor too large to hash whole
MAX_KEYS = 5000  # more keys than any case's genuine source: listed, not read one by one
_WHOLE = 1 << 22


# --- what a case is -------------------------------------------------------------------------


@dataclass(frozen=True)
class Interrupt:
    """Ctrl-C during a real export of the genuine checkpoint ``source``: SIGINT at the n-th
    call of ``trigger`` (``write``/``seek`` of the .pt writer's sink, the ``progress``
    callback) for every n, or after each of ``points`` delays spread over a clean export
    (``timer``)."""

    source: Path
    format: str = "pt"
    trigger: str = "write"
    nested: bool = False
    points: int = 24


@dataclass(frozen=True)
class Spec:
    """A checkpoint at ``path`` and what the promise says must happen to it.

    ``refused``: True, ``inspector.open`` raises an InspectorError; False, it opens; None,
    either. Once open, keys in ``bad`` fail to read with an InspectorError, keys in
    ``maybe_bad`` either read as in ``reference`` or fail so, every other key reads as in
    ``reference`` (a genuine checkpoint); with ``unknown_may_fail``, keys ``reference`` lacks
    are in ``maybe_bad`` too. Every error names ``file`` (and the key, for a key's step) and
    says ``says``. ``then``: a genuine checkpoint opened afterwards in the
    same process, which must read exactly as torch's own reader reads it. ``seconds``: the
    slowest a step may be; ``watchdog``: when a step counts as hung.
    """

    path: Path | None = None
    file: str | None = None
    refused: bool | None = False
    bad: frozenset[str] = frozenset()
    maybe_bad: frozenset[str] = frozenset()
    unknown_may_fail: bool = False
    says: str | None = None
    reference: Path | None = None
    then: Path | None = None
    exports: tuple[str, ...] = ("safetensors", "pt")
    interrupt: Interrupt | None = None
    seconds: float = SLOW_SECONDS
    watchdog: float = STEP_SECONDS
    probe: str | None = None  # the runner's self-check: segfault, abort, hang, poison, none


@dataclass
class Report:
    """What came back from the child: its exit status, stderr and step log."""

    returncode: int | None
    stderr: str
    records: list[dict[str, Any]]
    timed_out: bool = False


@dataclass
class Verdict:
    """``outcome``: "ok" or the first broken promise as ``kind@step``; all of them in
    ``problems``."""

    problems: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        return self.problems[0].split(" - ")[0] if self.problems else "ok"


# --- values compared by digest ---------------------------------------------------------------


def digest(value: Any) -> str:
    """A tensor's dtype, shape and bytes (a sample of its elements when huge); an object's
    repr."""
    import torch

    if not isinstance(value, torch.Tensor):
        return "object:" + hashlib.sha256(repr(value).encode()).hexdigest()
    value = value.detach()
    h = hashlib.sha256(f"{value.dtype} {tuple(value.shape)}".encode())
    numel = value.numel()
    if numel <= _WHOLE:
        h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    for i in range(SAMPLES):
        position, index = (i * 2654435761) % numel, []
        for n in reversed(value.shape):
            position, rest = divmod(position, n)
            index.append(rest)
        h.update(repr(value[tuple(reversed(index))].item()).encode())
    return h.hexdigest()


def inspector_digests(path: Path) -> dict[str, str]:
    """Digest of every readable key of a genuine checkpoint, read by the inspector."""
    import inspector

    ck = inspector.open(path)
    found = {}
    for entry in ck.entries():
        read = ck.read if entry.kind == "tensor" else ck.read_object
        found[entry.key] = digest(read(entry.key))
    return found


def torch_digests(path: Path, work: Path) -> dict[str, str]:
    """Digest of every tensor of a genuine checkpoint as torch itself loads it
    (``torch.load(weights_only=True)``; a DCP folder through ``dcp_to_torch_save``), keyed
    as DCP flattens nested dicts."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        work.mkdir(parents=True, exist_ok=True)
        dcp_to_torch_save(path, work / "truth.pt")
        path = work / "truth.pt"
    state, _ = flatten_state_dict(torch.load(path, weights_only=True))
    return {k: digest(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


# --- parent side -------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (frozenset, set, tuple)):
        return sorted(map(_plain, value)) if isinstance(value, (frozenset, set)) else list(value)
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def run(
    spec: Spec,
    work: Path,
    zygote: Zygote,
    *,
    reference: dict[str, str] | None = None,
    truth: dict[str, str] | None = None,
) -> Report:
    """Run ``spec`` in a child forked by ``zygote`` (warmed up on the genuine checkpoints);
    ``reference`` and ``truth`` are digests of ``spec.reference`` and ``spec.then``."""
    work.mkdir(parents=True, exist_ok=True)
    job = {
        "spec": {k: _plain(v) for k, v in vars(spec).items()},
        "reference": reference,
        "truth": truth,
        "work": str(work),
    }
    stderr = work / "stderr.txt"
    ended = zygote.run("tests.hostile.isolated:case", job, stderr, CHILD_SECONDS)
    text = stderr.read_text(errors="replace") if stderr.exists() else ""
    return Report(ended.returncode, text, ended.records, ended.timed_out)


# --- judging -------------------------------------------------------------------------------


def _last_started(report: Report) -> str:
    open_steps: dict[str, dict] = {}
    for rec in report.records:
        if rec["status"] == "start":
            open_steps[rec["step"]] = rec
        else:
            open_steps.pop(rec["step"], None)
    return next(reversed(open_steps), "startup") if open_steps else "after the last step"


def _frames(stderr: str) -> str:
    """Where faulthandler's dump says the child's main thread was: its innermost frame and
    the innermost frames in the inspector package."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stderr)
    main = next((b for b in blocks if "tests/hostile/isolated.py" in b), stderr)
    lines = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")]
    ours = [line for line in lines if "/inspector/" in line]
    picked = list(dict.fromkeys([*lines[:1], *ours[:4]]))
    first = next((line for line in stderr.splitlines() if line.strip()), "")
    return " | ".join([first.strip(), *picked]) if picked else stderr.strip()[-600:]


def _death(report: Report) -> str | None:
    """How the child died, if it did not finish."""
    where = _last_started(report)
    detail = _frames(report.stderr)
    if report.timed_out or "Timeout (" in report.stderr:
        return f"timeout@{where} - a step hung: {detail}"
    if report.returncode is not None and report.returncode < 0:
        name = signal.Signals(-report.returncode).name
        kind = "abort" if name == "SIGABRT" else f"crash:{name}"
        return f"{kind}@{where} - {detail}"
    if not any(r["step"] == "done" for r in report.records):
        return f"died@{where} - exit status {report.returncode}: {detail}"
    return None


def _located(rec: dict, spec: Spec, key: str | None) -> str | None:
    """Why an InspectorError record does not say where (None when it does)."""
    text = rec.get("message", "")
    if spec.file is not None and spec.file not in text:
        return f"does not name {spec.file!r}"
    if key is not None and repr(key) not in text:
        return f"does not name key {key!r}"
    if spec.says is not None and spec.says not in text:
        return f"does not say {spec.says!r}"
    return None


class _Judge:
    """Checks the records of one run against its spec."""

    def __init__(self, spec: Spec, report: Report, reference: dict | None, truth: dict | None):
        self.spec, self.report = spec, report
        self.reference, self.truth = reference or {}, truth or {}
        self.verdict = Verdict()
        self.ended = [r for r in report.records if r["status"] != "start"]
        self.by_step = {r["step"]: r for r in self.ended}

    def fail(self, problem: str) -> None:
        self.verdict.problems.append(problem)

    def __call__(self) -> Verdict:
        death = _death(self.report)
        if death:
            self.fail(death)
        self.generic()
        if self.spec.interrupt is not None:
            self.interrupts()
        elif self.spec.path is not None:
            self.exploration()
        if self.spec.then is not None and death is None:
            self.then()
        return self.verdict

    def generic(self) -> None:
        """No payload, no foreign exception, no memory blow-up, nothing slow, nothing changed
        in the module state shared with later checkpoints."""
        grew = False
        for rec in self.ended:
            step, status = rec["step"], rec["status"]
            if status in ("exception", "memory", "payload"):
                kind = "exception:" + rec.get("type", "?") if status == "exception" else status
                text = f"{rec.get('type')}: {rec.get('message', '')[:300]} (at {rec.get('where')})"
                self.fail(f"{kind}@{step} - {text}")
            if rec.get("seconds", 0) > self.spec.seconds:
                self.fail(f"slow@{step} - took {rec['seconds']:.1f} s")
            if not grew and (rec.get("rss", 0) > RSS_BYTES or rec.get("vm", 0) > VM_BYTES):
                grew = True
                self.fail(
                    f"memory@{step} - resident set grew {rec['rss'] / 2**20:.0f} MiB, "
                    f"address space {rec['vm'] / 2**20:.0f} MiB"
                )
        changed = self.by_step.get("fingerprint", {}).get("value")
        if changed:
            self.fail(f"poisoned@stand-ins - changed: {', '.join(changed)[:300]}")

    # --- exploring a hostile checkpoint ------------------------------------------------------

    def inspector_error(self, step: str, key: str | None, allowed: bool) -> bool:
        """Whether ``step`` ended in an InspectorError (checked to say where; a failure unless
        ``allowed``)."""
        rec = self.by_step.get(step)
        if rec is None or rec["status"] != "inspector-error":
            return False
        if not allowed:
            self.fail(f"error@{step} - {rec['type']}: {rec['message'][:300]}")
        elif why := _located(rec, self.spec, key):
            self.fail(f"unlocated@{step} - {why}: {rec['message'][:300]}")
        return True

    def exploration(self) -> None:
        spec = self.spec
        opened = self.by_step.get("open")
        if opened is None:
            return
        if opened["status"] == "inspector-error":
            if spec.refused is False:
                self.fail(f"refused@open - {opened['type']}: {opened['message'][:300]}")
            else:
                self.inspector_error("open", None, True)
            return
        if opened["status"] != "ok":
            return
        if spec.refused is True:
            self.fail("not-refused@open - opened, but the promise is a refusal")
        keys = opened["value"]["keys"]
        if opened["value"]["count"] > MAX_KEYS:
            self.fail(f"amplified@open - {opened['value']['count']} keys")
        either = spec.bad | spec.maybe_bad
        if spec.unknown_may_fail:
            either |= frozenset(k for k in keys if k not in self.reference)
        for step in ("repr", "table", "scan", *(s for s in self.by_step if s.startswith("tree:"))):
            self.inspector_error(step, None, False)
        missing = spec.bad - set(keys)
        if missing:
            self.fail(f"keys@open - bad keys not listed: {sorted(missing)[:5]}")
        kinds = {}
        for key in keys:
            kinds[key] = self.by_step.get(f"kind:{key}", {}).get("value")
            self.key_steps(key, either)
        table = self.by_step.get("table:final", {})
        if table.get("status") == "ok":
            marked = set(table["value"])
            if not spec.bad <= marked or not marked <= either:
                self.fail(
                    f"table@table:final - error column marks {sorted(marked)[:5]}, "
                    f"expected {sorted(spec.bad)[:5]}"
                )
        for step in ("diff:self",):
            rec = self.by_step.get(step, {})
            if rec.get("status") == "inspector-error":
                if rec.get("key") in either:
                    self.inspector_error(step, rec["key"], True)
                else:
                    self.inspector_error(step, None, False)
        rec = self.by_step.get("diff:reference", {})
        if rec.get("status") == "ok" and rec["value"]:
            self.fail(f"wrong@diff:reference - differ from the genuine: {rec['value'][:5]}")
        self.inspector_error("diff:reference", None, False)
        for fmt in spec.exports:
            self.export(fmt, kinds, either)

    def key_steps(self, key: str, either: frozenset[str]) -> None:
        spec = self.spec
        read = self.by_step.get(f"read:{key}")
        if read is None:
            return
        self.inspector_error(f"read:{key}", key, key in either)
        if key in spec.bad and read["status"] == "ok":
            self.fail(f"not-bad@read:{key} - read without error")
        same = read.get("value") == self.reference.get(key, read.get("value"))
        if read["status"] == "ok" and not same and key not in either:
            self.fail(f"wrong@read:{key} - differs from the genuine checkpoint")
        if read["status"] == "wrong":
            self.fail(f"wrong@read:{key} - {read['message']}")
        self.inspector_error(f"repr:{key}", key, False)
        stats = self.by_step.get(f"stats:{key}", {})
        if stats.get("status") == "inspector-error":
            allowed = key in either or stats["type"] == "UnsupportedError"
            self.inspector_error(f"stats:{key}", key, allowed)

    def export(self, fmt: str, kinds: dict[str, str | None], either: frozenset[str]) -> None:
        rec = self.by_step.get(f"export:{fmt}", {})
        self.inspector_error(f"export:{fmt}", None, False)
        left = self.by_step.get(f"leftovers:{fmt}", {}).get("value")
        if left:
            self.fail(f"leftovers@export:{fmt} - {left[:3]}")
        if rec.get("status") != "ok":
            return
        value = rec["value"]
        if not value["verified"]:
            self.fail(f"unverified@export:{fmt} - the written file does not read back as planned")
        skipped, excluded = set(value["skipped"]), set(value["excluded"])
        wanted = {
            k for k in self.spec.bad - excluded if fmt.startswith("pt") or kinds.get(k) == "tensor"
        }
        if not wanted <= skipped or not skipped <= either:
            self.fail(
                f"skipped@export:{fmt} - skipped {sorted(skipped)[:5]}, "
                f"expected {sorted(wanted)[:5]}"
            )

    # --- after the hostile one: a genuine checkpoint -------------------------------------------

    def then(self) -> None:
        opened = self.by_step.get("then:open", {})
        if opened.get("status") != "ok":
            why = f"{opened.get('type')}: {opened.get('message', '')[:300]}"
            self.fail(f"poisoned@then:open - {why}")
            return
        for key, want in self.truth.items():
            rec = self.by_step.get(f"then:read:{key}", {})
            if rec.get("status") != "ok" or rec.get("value") != want:
                got = rec.get("message") or "a different value"
                self.fail(f"poisoned@then:read:{key} - genuine key reads wrongly: {got[:200]}")
                return

    # --- interrupts ------------------------------------------------------------------------

    def interrupts(self) -> None:
        attempts = [r for r in self.ended if r["step"].startswith("interrupt:")]
        if not attempts and not self.verdict.problems:
            self.fail("untested@interrupt - no interrupt was delivered")
        for rec in attempts:
            if rec["status"] == "inspector-error":
                self.fail(f"error@{rec['step']} - {rec['type']}: {rec['message'][:200]}")
            if rec["status"] != "ok":
                continue
            value = rec["value"]
            if value["tmp"]:
                self.fail(f"leftovers@{rec['step']} - {value['tmp'][:3]}")
            if value["outcome"] == "swallowed":
                self.fail(f"swallowed@{rec['step']} - export returned; KeyboardInterrupt lost")
            if value["final"] and not value["complete"]:
                self.fail(f"partial@{rec['step']} - an incomplete file under the final name")


def judge(
    spec: Spec, report: Report, reference: dict | None = None, truth: dict | None = None
) -> Verdict:
    return _Judge(spec, report, reference, truth)()


# --- child side ------------------------------------------------------------------------------


def _status_kb(name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _classify(exc: BaseException) -> str:
    from inspector.errors import InspectorError
    from tests.hostile.guard import GuardViolation

    if isinstance(exc, GuardViolation):
        return "payload"
    if isinstance(exc, InspectorError):
        return "inspector-error"
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and re.search(r"alloc|out of memory", str(exc), re.I)
    ):
        return "memory"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupt"
    return "exception"


class Wrong(Exception):
    """A call returned, but not what it should (a dtype or shape other than listed)."""


class _Steps:
    """Runs calls as logged, guarded, watched steps."""

    def __init__(self, report: Callable[[dict], None], work: Path, watchdog: float) -> None:
        self.report, self.work, self.watchdog = report, work, watchdog
        self.baseline = _status_kb("VmHWM"), _status_kb("VmPeak")

    def write(self, **fields: Any) -> None:
        self.report(fields)

    def __call__(
        self, name: str, fn: Callable, *args: Any, summary: Callable | None = None, **kwargs: Any
    ) -> tuple[bool, Any]:
        """``(True, fn's result)`` or ``(False, None)``; the record holds ``summary(result)``."""
        import faulthandler

        from inspector.errors import InspectorError
        from tests.hostile.guard import guarded

        self.write(step=name, status="start")
        faulthandler.dump_traceback_later(self.watchdog, exit=True)
        start = time.perf_counter()
        fields: dict[str, Any] = {}
        result, ok = None, False
        try:
            with guarded(self.work):
                result = fn(*args, **kwargs)
                fields["value"] = summary(result) if summary else None
            fields["status"], ok = "ok", True
        except Wrong as exc:
            fields.update(status="wrong", message=str(exc))
        except BaseException as exc:  # every outcome is recorded, not raised
            fields.update(status=_classify(exc), type=type(exc).__name__, message=str(exc)[:2000])
            fields["where"] = where(exc)
            if isinstance(exc, InspectorError):
                fields.update(file=exc.file, key=exc.key)
        finally:
            faulthandler.cancel_dump_traceback_later()
        fields["seconds"] = time.perf_counter() - start
        fields["rss"] = max(0, _status_kb("VmHWM") - self.baseline[0]) * 1024
        fields["vm"] = max(0, _status_kb("VmPeak") - self.baseline[1]) * 1024
        self.write(step=name, **fields)
        return ok, result


def where(exc: BaseException) -> str:
    """The innermost frames of the inspector package an exception passed through."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/inspector/" in f.filename] or frames[-1:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[::-1][:3])


def _walk_tree(ck: Any, view: str) -> int:
    nodes = 0
    for node in ck.tree(view).walk():
        repr(node)
        node.by_dtype  # noqa: B018
        nodes += 1
    return nodes


def _listed(ck: Any) -> dict[str, Any]:
    return {"count": len(ck), "keys": ck.keys()[:MAX_KEYS]}


def _read_checked(ck: Any, key: str) -> Any:
    from inspector.dtypes import name_of

    entry = ck.entry(key)
    value = ck.read(key)
    if (name_of(value.dtype), tuple(value.shape)) != (entry.dtype, tuple(entry.shape)):
        raise Wrong(f"read {value.dtype} {list(value.shape)}, listed {entry.dtype} {entry.shape}")
    return value


def _errors_in_table(ck: Any) -> list[str]:
    table = ck.table()
    return sorted(table.key[table.error.notna()])


def _not_same(rows: Any) -> list[list[str]]:
    return [[k, s] for k, s in zip(rows.key, rows.status, strict=True) if s != "same"]


def _export(ck: Any, out: Path, fmt: str) -> dict[str, Any]:
    import inspector
    from tests.hostile.pipeline import export_options

    options = export_options(ck, "pt" if fmt.startswith("pt") else fmt)
    target = out / ("all.pt" if fmt.startswith("pt") else "all")
    result = inspector.export(ck, target, on_error="skip", nested=fmt == "pt-nested", **options)
    return {
        "skipped": sorted(k for k, why in result.skipped.items() if why.startswith("unreadable")),
        "excluded": sorted(options["exclude"]),
        "verified": result.verification is not None and result.verification.ok,
    }


def _temporaries(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*.tmp")) if folder.exists() else []


def _explore(steps: _Steps, spec: dict, work: Path) -> None:
    import inspector

    ok, ck = steps("open", inspector.open, spec["path"], summary=_listed)
    if not ok or len(ck) > MAX_KEYS:
        return
    from inspector.keys.spellings import VIEWS

    steps("repr", repr, ck)
    steps("table", _errors_in_table, ck, summary=lambda v: v)
    for view in VIEWS:
        steps(f"tree:{view}", _walk_tree, ck, view, summary=lambda n: n)
    steps("scan", ck.scan, progress=False)
    readable = []
    for key in ck.keys():
        entry = ck.entry(key)
        steps(f"entry:{key}", repr, entry)
        if entry.kind == "tensor":
            ok, _ = steps(f"read:{key}", _read_checked, ck, key, summary=digest)
            if ok:
                readable.append(key)
        else:
            ok, value = steps(f"read:{key}", ck.read_object, key, summary=digest)
            if ok:
                steps(f"repr:{key}", repr, value, summary=len)
        steps.write(step=f"kind:{key}", status="kind", value=entry.kind)
    steps("table:final", _errors_in_table, ck, summary=lambda v: v)
    steps("diff:self", inspector.diff, ck, ck, progress=False, summary=_not_same)
    if spec["reference"]:
        exclude = sorted(set(spec["bad"]) | set(spec["maybe_bad"]))
        steps(
            "diff:reference",
            inspector.diff,
            ck,
            spec["reference"],
            key_map=None,
            exclude=exclude,
            progress=False,
            summary=_not_same,
        )
    for fmt in spec["exports"]:
        steps(f"export:{fmt}", _export, ck, work / "out" / fmt, fmt, summary=lambda v: v)
        steps(f"leftovers:{fmt}", _temporaries, work / "out" / fmt, summary=lambda v: v)
    for key in readable:  # last: a statistics pass that never ends must not hide the rest
        steps(f"stats:{key}", ck.stats, key, summary=repr)


def _then(steps: _Steps, spec: dict, truth: dict[str, str]) -> None:
    import inspector

    ok, ck = steps("then:open", inspector.open, spec["then"], summary=lambda c: len(c))
    if ok:
        for key in truth:
            steps(f"then:read:{key}", ck.read, key, summary=digest)


# --- interrupting an export ------------------------------------------------------------------


class _Trigger:
    """Counts calls of the .pt writer's sink and of the progress callback, and raises SIGINT
    (the real signal, whatever handler is installed) at the chosen one."""

    def __init__(self) -> None:
        from inspector.formats.torch_save import writer

        self.counts: Counter[str] = Counter()
        self.kind: str | None = None
        self.at = 0
        self.fired = False
        sink = writer._Sink
        original_write, original_seek = sink.write, sink.seek

        def write(this: Any, data: Any) -> int:
            self.tick("write")
            return original_write(this, data)

        def seek(this: Any, offset: int, whence: int = os.SEEK_SET) -> int:
            self.tick("seek")
            return original_seek(this, offset, whence)

        sink.write, sink.seek = write, seek

    def tick(self, kind: str) -> None:
        self.counts[kind] += 1
        if kind == self.kind and self.counts[kind] == self.at and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)

    def arm(self, kind: str | None, at: int) -> None:
        self.counts.clear()
        self.kind, self.at, self.fired = kind, at, False


def _export_once(ck: Any, target: Path, job: dict, trigger: _Trigger) -> None:
    import inspector
    from tests.hostile.pipeline import export_options

    options = export_options(ck, job["format"])
    inspector.export(
        ck,
        target,
        nested=job["nested"],
        on_progress=lambda _: trigger.tick("progress"),
        **options,
    )


def _complete(target: Path, clean: Path) -> bool:
    if clean.is_dir():
        return target.is_dir() and all(
            (target / p.name).is_file() and (target / p.name).read_bytes() == p.read_bytes()
            for p in clean.iterdir()
        )
    return target.is_file() and target.read_bytes() == clean.read_bytes()


def _attempt(ck: Any, job: dict, trigger: _Trigger, folder: Path, clean: Path, delay: float):
    import threading

    target = folder / clean.name
    timer = None
    outcome = "completed"
    try:
        try:
            if delay >= 0:
                timer = threading.Timer(
                    delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
                )
                timer.start()
            _export_once(ck, target, job, trigger)
        finally:
            if timer is not None:
                timer.join()
        for _ in range(1000):  # a pending SIGINT is handled between these bytecodes
            pass
        if trigger.fired or timer is not None:  # the signal was sent, and nothing came of it
            outcome = "swallowed"
    except KeyboardInterrupt:
        outcome = "interrupted"
    finals = [target / p.name for p in clean.iterdir()] if clean.is_dir() else [target]
    return {
        "outcome": outcome,
        "tmp": _temporaries(folder),
        "final": any(p.exists() for p in finals),
        "complete": _complete(target, clean),
    }


def _interrupts(steps: _Steps, job: dict, work: Path) -> None:
    import inspector

    ok, ck = steps("open", inspector.open, job["source"], summary=len)
    if not ok:
        return
    trigger = _Trigger()
    out = work / "out"
    clean = out / "clean" / ("export.pt" if job["format"] == "pt" else "export")
    start = time.perf_counter()
    ok, _ = steps("export:clean", _export_once, ck, clean, job, trigger)
    duration = time.perf_counter() - start
    if not ok:
        return
    total = trigger.counts[job["trigger"]] if job["trigger"] != "timer" else job["points"]
    steps.write(step="counts", status="counted", value=dict(trigger.counts))
    for n in range(1, total + 1):
        folder = out / f"{job['trigger']}-{n}"
        if job["trigger"] == "timer":
            trigger.arm(None, 0)
            delay = duration * 1.2 * (n - 1) / max(1, total - 1)
        else:
            trigger.arm(job["trigger"], n)
            delay = -1.0
        steps(
            f"interrupt:{job['trigger']}#{n}",
            _attempt,
            ck,
            job,
            trigger,
            folder,
            clean,
            delay,
            summary=lambda v: v,
        )


# --- the child's main ------------------------------------------------------------------------


def warm_up(paths: list[str], work: Path) -> None:
    """Every entry point once on genuine checkpoints, and the modules hostile input may
    reach, so nothing is imported for the first time inside a guarded step."""
    import bz2  # noqa: F401
    import lzma  # noqa: F401
    import threading  # noqa: F401

    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import torch
    import tqdm.auto  # noqa: F401
    import zstandard  # noqa: F401

    import inspector
    from inspector import dtypes
    from tests.hostile.pipeline import export_options

    for i, path in enumerate(paths):
        ck = inspector.open(path)
        ck.table()
        ck.scan(progress=False)
        for view in ("stored", "flattened", "prefixed"):
            _walk_tree(ck, view)
        for entry in ck.entries():
            if entry.error:
                continue
            if entry.kind == "tensor":
                ck.read(entry.key)
                if dtypes.is_real(entry.dtype):
                    ck.stats(entry.key)
            else:
                repr(ck.read_object(entry.key))
        inspector.diff(ck, ck, progress=False)
        for fmt in ("safetensors", "pt"):
            target = work / "warm" / str(i) / ("w.pt" if fmt == "pt" else "w")
            inspector.export(ck, target, **export_options(ck, fmt))
        if i == 0:
            torch.load(target, weights_only=True)


def _stand_ins() -> dict[str, Any]:
    """The module-level objects pickles are resolved to, shared by every checkpoint opened:
    the resolver's tables, what they hold, and the record classes decoding builds."""
    import torch

    from inspector.formats.dcp import metadata as dcp_metadata
    from inspector.formats.safe_pickle import policy, records

    found: dict[str, Any] = {}
    tables = {
        "data": policy._DATA_GLOBALS,
        "builtins": policy._SAFE_BUILTINS,
        "legacy": policy._LEGACY_STORAGE,
        "paths": policy._PATH_CLASSES,
        "named": policy._NAMED,
        "dtypes": policy._DTYPES,
        "metadata": policy._metadata_table(),
        "dcp": dcp_metadata.CLASSES,
    }
    for table, items in tables.items():
        found[f"table:{table}"] = items
        for name, value in items.items():
            found[f"{table}:{name}"] = value
    classes = [v for v in vars(records).values() if isinstance(v, type)]
    classes += [v for v in vars(dcp_metadata).values() if isinstance(v, type)]
    for value in (
        *classes,
        policy._UNTYPED,
        policy._DEVICE,
        records.TENSOR,
        records.PARAMETER,
        torch.Tensor,
        torch.nn.Parameter,
        torch.Size,
        torch.device,
    ):
        found[repr(value)] = value
    return found


def _state(value: Any) -> dict[str, Any]:
    """What BUILD or setattr could change on ``value``: its ``__dict__`` (a table's items),
    its slots, a function's defaults (an allow-listed function's too)."""
    state: dict[str, Any] = {}
    if isinstance(value, dict):
        state.update(value)
    attributes = getattr(value, "__dict__", None)
    if attributes is not None:
        state.update(attributes)
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                state[name] = getattr(value, name)
    for target in (value, state.get("_fn")):
        for name in ("__defaults__", "__kwdefaults__"):
            if hasattr(target, name):
                state[name] = repr(getattr(target, name))
    return state


def _fingerprint() -> dict[str, str]:
    out = {}
    for label, value in _stand_ins().items():
        for name, item in _state(value).items():
            text = item if isinstance(item, str) else f"{id(item)}:{type(item).__name__}"
            out[f"{label}.{name}"] = text
    return out


def _changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _probe(kind: str) -> None:
    """Misbehave as a broken reader would, so tests can check the runner notices."""
    from inspector.formats.safe_pickle import policy

    if kind == "segfault":
        sys.modules["ctypes"].string_at(0)
    elif kind == "abort":
        os.abort()
    elif kind == "hang":
        while True:
            time.sleep(1)
    elif kind == "poison":
        object.__setattr__(policy._LEGACY_STORAGE["FloatStorage"], "dtype", "int32")


def prepare(setup: dict[str, Any]) -> None:
    """The zygote's warm-up (see tests/hostile/zygote.py): every entry point on every
    genuine checkpoint, one thread for torch, the guard's audit hook installed."""
    import ctypes  # noqa: F401  (for the segfault probe: a fresh import would be stopped)
    import faulthandler  # noqa: F401
    import resource  # noqa: F401
    import traceback  # noqa: F401

    import torch
    import tqdm

    torch.set_num_threads(1)
    tqdm.tqdm.monitor_interval = 0  # no monitor thread: a fork copies only the main thread
    warm_up(setup["warm"], Path(setup["work"]))
    import tests.hostile.guard  # noqa: F401  (installs the audit hook)


def case(job: dict[str, Any], report: Callable[[dict], None]) -> None:
    """A forked child's work: the case's steps, reported as they happen."""
    spec, work = job["spec"], Path(job["work"])
    before = _fingerprint()
    Path("/proc/self/clear_refs").write_text("5")
    steps = _Steps(report, work, spec["watchdog"])
    if spec["probe"]:
        steps("probe", _probe, spec["probe"])
    if spec["interrupt"]:
        _interrupts(steps, spec["interrupt"], work)
    elif spec["path"]:
        _explore(steps, spec, work)
    if spec["then"]:
        _then(steps, spec, job["truth"] or {})
    steps.write(step="fingerprint", status="checked", value=_changed(before, _fingerprint()))
    steps.write(step="done", status="done")
