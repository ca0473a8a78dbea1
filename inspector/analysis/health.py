"""Run health: what changed between the saved steps of a training run, read from the
weights and the optimizer state, and what looks wrong (findings with plain messages).

Per model parameter and saved step: L2 norm, RMS, max |w|, NaN / Inf counts, fraction of
zeros; against the step before: the update ratio ``‖w_t − w_{t−1}‖ / ‖w_{t−1}‖`` and the
cosine between successive updates; from Adam-style state (``exp_avg``, ``exp_avg_sq``,
``step``): the RMS of both moments and of the effective step ``lr·m̂/(√v̂+eps)`` (where the
checkpoint keeps ``lr``, ``betas`` and ``eps``). Layers aggregate their parameters (grouped by
the layer index in the key).

Streaming: parameters are visited one at a time through every step, each tensor read once per
step in cache-sized blocks that every metric is taken from (:mod:`.health_pass`), so memory
holds one parameter's previous value and last update (float32) and the blocks, whatever the
run's size; remote runs read ranges. ``workers=N`` splits the parameters across processes
(:mod:`.health_workers`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from inspector.analysis import health_pass
from inspector.analysis.optimizer_state import Adam as _Adam
from inspector.analysis.optimizer_state import Pairing, pair_optimizer
from inspector.analysis.stats import layer_index, layer_name
from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.entry import Entry
from inspector.errors import InspectorError, MissingKeyError, UsageError
from inspector.formats.base import Step
from inspector.keys.spellings import canonical_fqn, model_fqn
from inspector.progress import Counter, ProgressFn
from inspector.words import counted

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

# kind -> (severity, what it means), severities as the audit's (analysis/findings.py).
KINDS: dict[str, tuple[str, str]] = {
    "non-finite": ("error", "NaN or infinite weights or optimizer moments"),
    "unreadable": ("error", "a tensor that cannot be read (damaged or missing bytes)"),
    "norm-jump": ("warning", "the weight norm changed by more than norm_jump x between steps"),
    "update-outlier": ("warning", "an update ratio update_outlier x its reference median"),
    "frozen": ("warning", "a parameter that stopped changing while the others train"),
    "step-mismatch": ("warning", "optimizer step counters that disagree within a step"),
    "zero-second-moment": ("warning", "exp_avg_sq all zero: no gradient ever reached it"),
    "dead-rows": ("warning", "rows (or columns) of a matrix that are all zero"),
    "outlier-channels": ("warning", "channels whose max |w| is channel_outlier x the median"),
    "cannot-pair": ("info", "optimizer state kept by number that names no parameter soundly"),
}
METRICS = (
    "l2",
    "rms",
    "absmax",
    "nan",
    "inf",
    "zero_fraction",
    "update_ratio",
    "update_cosine",
    "exp_avg_rms",
    "exp_avg_sq_rms",
    "effective_step_rms",
)
_MIN_REFERENCE = 3  # values a median needs before outliers are judged against it


@dataclass(frozen=True)
class Thresholds:
    """When a finding is raised: ``norm_jump`` (norm ratio between steps, either way),
    ``update_outlier`` (update ratio over the median of the same parameter in the other
    layers at that step, or of its own steps), ``channel_outlier`` (a row's or column's max
    |w| over the median of them)."""

    norm_jump: float = 1.5
    update_outlier: float = 10.0
    channel_outlier: float = 10.0


@dataclass(frozen=True)
class ParamHealth:
    """One model parameter at one saved step (the update fields: against the step before;
    the optimizer fields: None where the checkpoint keeps no such state)."""

    step: int | None
    step_name: str
    key: str
    layer: int | None
    group: str
    numel: int
    l2: float
    rms: float
    absmax: float
    nan: int
    inf: int
    zero_fraction: float
    update_l2: float | None = None
    update_ratio: float | None = None
    update_cosine: float | None = None
    exp_avg_rms: float | None = None
    exp_avg_sq_rms: float | None = None
    effective_step_rms: float | None = None
    second_moment_zero_fraction: float | None = None
    optimizer_step: float | None = None
    dead_rows: int = 0
    dead_columns: int = 0
    outlier_rows: int = 0
    outlier_columns: int = 0
    channel_ratio: float | None = None


@dataclass(frozen=True)
class HealthFinding:
    """Something that looks wrong: its ``kind`` (a key of ``KINDS``), the parameter, layer
    and step it concerns, the number that tripped it and a plain-language message."""

    kind: str
    step: int | None
    step_name: str
    key: str | None
    layer: int | None
    value: float | None
    message: str

    @property
    def severity(self) -> str:
        return KINDS[self.kind][0]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "severity": self.severity}


@dataclass(frozen=True)
class HealthReport:
    """What :func:`health` found over a run's steps: one row per parameter and step
    (``rows``), the findings, and the thresholds they were judged by."""

    run: str
    steps: tuple[Step, ...]
    rows: tuple[ParamHealth, ...]
    findings: tuple[HealthFinding, ...]
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def ok(self) -> bool:
        """No finding at all."""
        return not self.findings

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def table(self) -> pandas.DataFrame:
        """One row per parameter and step, the fields of :class:`ParamHealth`."""
        import pandas

        columns = [f.name for f in fields(ParamHealth)]
        return pandas.DataFrame([asdict(r) for r in self.rows], columns=columns)

    def layers(self) -> list[dict[str, Any]]:
        """Per group (a layer, or a parameter outside the layers) and step: the metrics of
        its parameters together (norms summed in quadrature, RMS over all elements)."""
        return layer_rows(self.rows)

    def grid(self, metric: str = "update_ratio") -> tuple[list[str], list[str], list[list[float]]]:
        """(groups, step names, values[group][step]) of one metric (NaN where none)."""
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, not {metric!r}")
        rows = self.layers()
        groups = list(dict.fromkeys(r["group"] for r in rows))
        names = [s.name for s in self.steps]
        values = {(r["group"], r["step_name"]): r[metric] for r in rows}
        return groups, names, [[_number(values.get((g, n))) for n in names] for g in groups]

    def plot(self, metric: str = "update_ratio", *, ax: Any = None) -> Figure:
        """A layer x step heatmap of ``metric`` (log colour scale for positive metrics)."""
        return plot_grid(*self.grid(metric), metric, ax=ax)

    def text(self) -> str:
        head = (
            f"{self.run}: {counted(len(self.steps), 'step')}, "
            f"{counted(len({r.key for r in self.rows}), 'parameter')}"
        )
        if self.ok:
            return f"{head}: nothing looks wrong"
        lines = [f"{head}: {counted(len(self.findings), 'finding')}"]
        lines += [f"- [{f.severity}] {f.step_name}: {f.message}" for f in self.findings]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The ``ckpt-inspect health --json`` shape (see the README's Run health section)."""
        return {
            "run": self.run,
            "steps": [{"name": s.name, "number": s.number} for s in self.steps],
            "thresholds": asdict(self.thresholds),
            "ok": self.ok,
            "errors": self.has_errors,
            "findings": [f.as_dict() for f in self.findings],
            "layers": self.layers(),
            "parameters": [asdict(r) for r in self.rows],
        }


def health(
    run_or_ck: Checkpoint | str | Any,
    steps: Iterable[str | int] | None = None,
    keys: Iterable[str] | None = None,
    *,
    thresholds: Thresholds | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
    workers: int = 1,
) -> HealthReport:
    """Health of a training run: ``run_or_ck`` is a run folder (or URL), or a checkpoint
    opened from one (its ``ck.steps``); a checkpoint outside a run is one step. ``steps``
    picks saved steps by name or number, ``keys`` model parameters by glob on their name.
    ``workers``: processes the parameters are split across (each reopens the steps by their
    location with ``storage_options``); the report is the same as with one."""
    if not isinstance(workers, int) or workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers!r}")
    ck = as_checkpoint(run_or_ck, storage_options)
    chosen = _chosen_steps(ck, steps)
    opened = [_open_step(ck, s, storage_options) for s in chosen]
    params = _parameters(opened, keys)
    pairings = [pair_optimizer(c) for c in opened]
    optimizer = [p.params for p in pairings]
    sizes = {
        name: sum(
            c.entry(key).numel for c, key in zip(opened, per_step, strict=True) if key is not None
        )
        for name, per_step in params.items()
    }
    counter = Counter(sum(sizes.values()), on_progress, cancel)
    limits = thresholds or Thresholds()
    if workers > 1 and len(params) > 1:
        from inspector.analysis import health_workers

        walked = health_workers.walk(
            workers, chosen, storage_options, params, sizes, counter, limits, (_walk, _paired)
        )
    else:
        workspace = health_pass.Workspace()
        with health_pass.one_thread():
            walked = [
                _walk(name, per_step, opened, chosen, optimizer, counter, limits, workspace)
                for name, per_step in params.items()
            ]
    rows = [row for found, _ in walked for row in found]
    unreadable = [finding for _, failed in walked for finding in failed]
    order = {s.name: i for i, s in enumerate(chosen)}
    judged = [*unreadable, *_unpaired(pairings, chosen), *find(rows, limits)]
    findings = sorted(judged, key=lambda f: order[f.step_name])
    return HealthReport(ck.location, tuple(chosen), tuple(rows), tuple(findings), limits)


# --- the steps and what they hold ----------------------------------------------------------
def _chosen_steps(ck: Checkpoint, steps: Iterable[str | int] | None) -> list[Step]:
    run = list(ck.steps) or [Step(ck.location, None, ck.location, opened=True)]
    if steps is None:
        return run
    wanted = [str(s) for s in steps]
    chosen = [s for s in run if s.name in wanted or str(s.number) in wanted]
    if len(chosen) != len(wanted):
        names = ", ".join(s.name for s in run)
        raise UsageError(
            f"steps {wanted} are not all saved steps of the run ({names})", file=ck.location
        )
    return chosen


def _open_step(ck: Checkpoint, step: Step, storage_options: Mapping[str, Any] | None) -> Checkpoint:
    if step.opened:
        return ck
    from inspector.checkpoint import open as open_checkpoint

    return open_checkpoint(step.location, storage_options)


def _paired(ck: Checkpoint) -> dict[str, _Adam]:
    """A step's Adam state by parameter (the worker processes' lister)."""
    return pair_optimizer(ck).params


def _parameters(
    opened: list[Checkpoint], keys: Iterable[str] | None
) -> dict[str, list[str | None]]:
    """Model parameter name -> its stored key in each step (None where a step lacks it)."""
    globs = list(keys) if keys is not None else None
    found: dict[str, list[str | None]] = {}
    for i, ck in enumerate(opened):
        for entry in ck.entries():
            fqn = model_fqn(entry)
            if fqn is None or entry.kind != "tensor" or not _floating(entry):
                continue
            name = canonical_fqn(fqn)
            if globs is not None and not any(fnmatch.fnmatchcase(name, g) for g in globs):
                continue
            found.setdefault(name, [None] * len(opened))[i] = entry.key
    return found


def stored_key(ck: Checkpoint, name: str) -> str:
    """The key a model parameter named ``name`` (as in the report) is stored under in ``ck``."""
    for entry in ck.entries():
        fqn = model_fqn(entry)
        if fqn is not None and canonical_fqn(fqn) == name:
            return entry.key
    raise MissingKeyError(f"no model parameter named {name!r}", file=ck.location, key=name)


def _floating(entry: Entry) -> bool:
    return entry.dtype is not None and ("float" in entry.dtype or entry.dtype.startswith("bf"))


# --- one parameter through the steps -------------------------------------------------------
def _walk(
    name: str,
    per_step: Sequence[str | None],
    opened: Sequence[Checkpoint],
    chosen: Sequence[Step],
    optimizer: Sequence[dict[str, _Adam]],
    counter: Counter,
    limits: Thresholds,
    workspace: health_pass.Workspace,
) -> tuple[list[ParamHealth], list[HealthFinding]]:
    """The parameter's rows, step by step, and the steps where it could not be read."""
    rows, unreadable = [], []
    carried: health_pass.Carried | None = None
    for ck, key, step, adam in zip(opened, per_step, chosen, optimizer, strict=True):
        if key is None:
            carried = None
            continue
        try:
            moments = _moments(ck, adam.get(name), workspace)
        except InspectorError as exc:
            unreadable.append(_unreadable(name, step, "its optimizer state", exc))
            moments = {}
        before = carried
        try:
            numbers, carried = health_pass.weights(ck, key, carried, workspace)
        except InspectorError as exc:
            unreadable.append(_unreadable(name, step, "its weights", exc))
            carried = None
            continue
        row = _weights(numbers, step, name, ck.entry(key).numel, limits.channel_outlier)
        if numbers.update_l2 is not None and before is not None:
            row = _with_update(row, numbers, before)
        rows.append(_replace(row, **moments))
        counter.step(row.numel)
    return rows, unreadable


def _unpaired(pairings: Sequence[Pairing], chosen: Sequence[Step]) -> list[HealthFinding]:
    """Optimizer state that names no parameter, or cannot be read, per step."""
    found = []
    for pairing, step in zip(pairings, chosen, strict=True):
        found += [
            HealthFinding(
                "cannot-pair", step.number, step.name, None, None, float(u.count), u.message
            )
            for u in pairing.unpaired
        ]
        found += [
            HealthFinding(
                "unreadable", step.number, step.name, None, None, None,
                f"the optimizer state cannot be read at {step.name}: {error}",
            )
            for error in pairing.damaged
        ]  # fmt: skip
    return found


def _unreadable(name: str, step: Step, what: str, exc: InspectorError) -> HealthFinding:
    return HealthFinding(
        "unreadable",
        step.number,
        step.name,
        name,
        layer_index(name),
        None,
        f"{name}: {what} cannot be read at {step.name}: {exc}",
    )


def _weights(
    numbers: health_pass.WeightNumbers, step: Step, name: str, numel: int, k: float
) -> ParamHealth:
    index = layer_index(name)
    return ParamHealth(
        step=step.number,
        step_name=step.name,
        key=name,
        layer=index,
        group=f"layer {index}" if index is not None else name,
        numel=numel,
        l2=numbers.l2,
        rms=numbers.l2 / math.sqrt(numel) if numel else 0.0,
        absmax=numbers.absmax,
        nan=numbers.nan,
        inf=numbers.inf,
        zero_fraction=numbers.zeros / numel if numel else 0.0,
        **_channels(numbers.rows, numbers.columns, k),
    )


def _channels(rows: torch.Tensor | None, columns: torch.Tensor | None, k: float) -> dict[str, Any]:
    """Rows and columns of a matrix (their max |w|): all zero (dead), or with a max |w| over
    ``k`` x the median channel's."""
    if rows is None or columns is None or not bool(rows.any()):
        return {}
    medians = [float(rows.median()), float(columns.median())]
    ratio = max(float(c.max()) / m for c, m in zip((rows, columns), medians, strict=True) if m > 0)
    return {
        "dead_rows": int((rows == 0).sum()),
        "dead_columns": int((columns == 0).sum()),
        "outlier_rows": _above(rows, medians[0], k),
        "outlier_columns": _above(columns, medians[1], k),
        "channel_ratio": ratio,
    }


def _above(values: torch.Tensor, median: float, k: float) -> int:
    return int((values > k * median).sum()) if median > 0 else 0


def _with_update(
    row: ParamHealth, numbers: health_pass.WeightNumbers, before: health_pass.Carried
) -> ParamHealth:
    l2 = numbers.update_l2 or 0.0
    cosine = None
    if numbers.update_dot is not None and before.update_l2 is not None:
        norms = l2 * before.update_l2
        cosine = numbers.update_dot / norms if norms > 0 else None
    ratio = l2 / before.l2 if before.l2 > 0 else None
    return _replace(row, update_l2=l2, update_ratio=ratio, update_cosine=cosine)


def _moments(
    ck: Checkpoint, adam: _Adam | None, workspace: health_pass.Workspace
) -> dict[str, Any]:
    """RMS of the moments and of the effective step; exp_avg_sq's zero fraction; the step."""
    if adam is None:
        return {}
    found: dict[str, Any] = {}
    step = _float(adam.value(ck, "step"))
    found["optimizer_step"] = step
    m_key, v_key = adam.states.get("exp_avg"), adam.states.get("exp_avg_sq")
    if m_key is None or v_key is None:
        return found
    lr, betas, eps = (adam.value(ck, h) for h in ("lr", "betas", "eps"))
    scale = _step_scale(lr, betas, eps, step)
    sums = health_pass.moments(ck, m_key, v_key, scale[0] if scale else None, workspace)
    n = sums.numel
    found["exp_avg_rms"] = math.sqrt(sums.m_squares / n) if n else 0.0
    found["exp_avg_sq_rms"] = math.sqrt(sums.v_squares / n) if n else 0.0
    found["second_moment_zero_fraction"] = sums.v_zeros / n if n else 0.0
    if sums.step_squares is not None and scale is not None:
        found["effective_step_rms"] = (math.sqrt(sums.step_squares / n) if n else 0.0) * scale[1]
    return found


def _step_scale(lr: Any, betas: Any, eps: Any, step: float | None) -> tuple[float, float] | None:
    """lr·(m/(1-β1^t)) / (√(v/(1-β2^t)) + eps) = f · m / (√v + e): (e, f), the scalars
    folded out of the pass (None without the hyper-parameters or a step)."""
    if lr is None or betas is None or eps is None or not step:
        return None
    beta1, beta2 = (float(b) for b in betas)
    root = math.sqrt(1 - beta2**step)
    return float(eps) * root, float(lr) * root / (1 - beta1**step)


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float, torch.Tensor)) else None


def _replace(row: ParamHealth, **changes: Any) -> ParamHealth:
    return dataclasses.replace(row, **changes)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


# --- layers ----------------------------------------------------------------------------
def layer_rows(rows: Sequence[ParamHealth]) -> list[dict[str, Any]]:
    """Per (group, step), in order of appearance: the group's parameters together."""
    by: dict[tuple[str, str], list[ParamHealth]] = {}
    for row in rows:
        by.setdefault((row.group, row.step_name), []).append(row)
    out = []
    l2_before: dict[str, float] = {}
    for (group, step_name), members in by.items():
        numel = sum(r.numel for r in members)
        l2 = math.sqrt(sum(r.l2**2 for r in members))
        updates = [r.update_l2 for r in members if r.update_l2 is not None]
        before = l2_before.get(group)
        out.append(
            {
                "group": group,
                "layer": members[0].layer,
                "step": members[0].step,
                "step_name": step_name,
                "parameters": len(members),
                "numel": numel,
                "l2": l2,
                "rms": l2 / math.sqrt(numel) if numel else 0.0,
                "absmax": max(r.absmax for r in members),
                "nan": sum(r.nan for r in members),
                "inf": sum(r.inf for r in members),
                "zero_fraction": sum(r.zero_fraction * r.numel for r in members) / numel,
                "update_ratio": (
                    math.sqrt(sum(u**2 for u in updates)) / before if updates and before else None
                ),
                "update_cosine": _mean([r.update_cosine for r in members]),
                "exp_avg_rms": _pooled_rms(members, "exp_avg_rms"),
                "exp_avg_sq_rms": _pooled_rms(members, "exp_avg_sq_rms"),
                "effective_step_rms": _pooled_rms(members, "effective_step_rms"),
            }
        )
        l2_before[group] = l2
    return out


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _pooled_rms(members: Sequence[ParamHealth], name: str) -> float | None:
    pairs = [(getattr(r, name), r.numel) for r in members if getattr(r, name) is not None]
    if not pairs:
        return None
    return math.sqrt(sum(v**2 * n for v, n in pairs) / sum(n for _, n in pairs))


# --- findings ------------------------------------------------------------------------------
def find(rows: Sequence[ParamHealth], limits: Thresholds) -> list[HealthFinding]:
    """Every finding in the rows, by step then parameter."""
    found = [
        *_non_finite(rows),
        *_norm_jumps(rows, limits),
        *_update_outliers(rows, limits),
        *_frozen(rows),
        *_step_mismatch(rows),
        *_zero_moments(rows),
        *_channels_found(rows, limits),
    ]
    order = {name: i for i, name in enumerate(dict.fromkeys(r.step_name for r in rows))}
    return sorted(found, key=lambda f: (order.get(f.step_name, -1), f.key or "", f.kind))


def _finding(kind: str, row: ParamHealth, value: float | None, message: str) -> HealthFinding:
    return HealthFinding(kind, row.step, row.step_name, row.key, row.layer, value, message)


def _history(rows: Sequence[ParamHealth]) -> dict[str, list[ParamHealth]]:
    by: dict[str, list[ParamHealth]] = {}
    for row in rows:
        by.setdefault(row.key, []).append(row)
    return by


def _non_finite(rows: Sequence[ParamHealth]) -> list[HealthFinding]:
    return [
        _finding(
            "non-finite",
            r,
            float(r.nan + r.inf),
            f"{r.key} holds {r.nan} NaN and {r.inf} infinite values",
        )
        for r in rows
        if r.nan or r.inf
    ]


def _norm_jumps(rows: Sequence[ParamHealth], limits: Thresholds) -> list[HealthFinding]:
    found = []
    for history in _history(rows).values():
        for before, row in itertools.pairwise(history):
            if before.l2 <= 0 or row.l2 <= 0:
                continue
            ratio = row.l2 / before.l2
            if ratio > limits.norm_jump or ratio < 1 / limits.norm_jump:
                found.append(
                    _finding(
                        "norm-jump",
                        row,
                        ratio,
                        f"{row.key}'s L2 norm went from {before.l2:.4g} at {before.step_name} to "
                        f"{row.l2:.4g} ({ratio:.3g}x; threshold {limits.norm_jump:g}x)",
                    )
                )
    return found


def _update_outliers(rows: Sequence[ParamHealth], limits: Thresholds) -> list[HealthFinding]:
    """Each update ratio against the median of the same parameter in the other layers at that
    step (three or more layers), else against the median of its own steps (three or more)."""
    family: dict[tuple[str | None, str], list[float]] = {}
    for r in rows:
        if r.update_ratio is not None:
            family.setdefault((layer_name(r.key), r.step_name), []).append(r.update_ratio)
    own = {
        key: [r.update_ratio for r in h if r.update_ratio is not None]
        for key, h in _history(rows).items()
    }
    found = []
    for r in rows:
        if r.update_ratio is None:
            continue
        peers = family.get((layer_name(r.key), r.step_name), []) if layer_name(r.key) else []
        reference, what = (
            (peers, "the same parameter across layers")
            if len(peers) >= _MIN_REFERENCE
            else (own[r.key], "its own steps")
        )
        if len(reference) < _MIN_REFERENCE:
            continue
        median = _median(reference)
        if median > 0 and r.update_ratio > limits.update_outlier * median:
            found.append(
                _finding(
                    "update-outlier",
                    r,
                    r.update_ratio / median,
                    f"{r.key} changed by {r.update_ratio:.3g} of its norm up to {r.step_name}, "
                    f"{r.update_ratio / median:.3g}x the median of {what} ({median:.3g}); "
                    "a loss spike starting here?",
                )
            )
    return found


def _frozen(rows: Sequence[ParamHealth]) -> list[HealthFinding]:
    """Parameters unchanged over an interval where the others changed: reported once, at the
    first step they stopped at."""
    moving = {r.step_name for r in rows if r.update_ratio}
    found = []
    for history in _history(rows).values():
        still = [r for r in history if r.update_ratio == 0.0 and r.step_name in moving]
        if still:
            first = still[0]
            found.append(
                _finding(
                    "frozen",
                    first,
                    0.0,
                    f"{first.key} did not change up to {first.step_name} "
                    f"(nor in {counted(len(still) - 1, 'later interval')}) while other parameters "
                    "trained: "
                    "frozen (requires_grad=False, zero learning rate)?",
                )
            )
    return found


def _step_mismatch(rows: Sequence[ParamHealth]) -> list[HealthFinding]:
    """Step counters unlike most parameters' at that step: reported once per parameter, at
    the first step they disagree."""
    by_step: dict[str, list[float]] = {}
    for r in rows:
        if r.optimizer_step is not None:
            by_step.setdefault(r.step_name, []).append(r.optimizer_step)
    usual = {name: _median(steps) for name, steps in by_step.items()}
    found = []
    for history in _history(rows).values():
        odd = [r for r in history if r.optimizer_step not in (None, usual.get(r.step_name))]
        if odd:
            first = odd[0]
            found.append(
                _finding(
                    "step-mismatch",
                    first,
                    first.optimizer_step,
                    f"{first.key}'s optimizer step counter is {first.optimizer_step:g} at "
                    f"{first.step_name} where most parameters' are {usual[first.step_name]:g} "
                    f"(and at {counted(len(odd) - 1, 'later step')}): it stopped training, or "
                    "was reset",
                )
            )
    return found


def _zero_moments(rows: Sequence[ParamHealth]) -> list[HealthFinding]:
    return [
        _finding(
            "zero-second-moment",
            r,
            1.0,
            f"{r.key}'s exp_avg_sq is all zero: no gradient ever reached it (dead or frozen)",
        )
        for r in rows
        if r.second_moment_zero_fraction == 1.0
    ]


def _channels_found(rows: Sequence[ParamHealth], limits: Thresholds) -> list[HealthFinding]:
    found = []
    for r in rows:
        if r.dead_rows or r.dead_columns:
            found.append(
                _finding(
                    "dead-rows",
                    r,
                    float(r.dead_rows + r.dead_columns),
                    f"{r.key} has {r.dead_rows} all-zero rows and {r.dead_columns} all-zero "
                    "columns",
                )
            )
        if r.channel_ratio is not None and r.channel_ratio > limits.channel_outlier:
            found.append(
                _finding(
                    "outlier-channels",
                    r,
                    r.channel_ratio,
                    f"{r.key} has channels whose max |w| is {r.channel_ratio:.3g}x the median "
                    f"channel's (threshold {limits.channel_outlier:g}x)",
                )
            )
    return found


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# --- the heatmap ------------------------------------------------------------------------------
def plot_grid(
    groups: list[str], names: list[str], values: list[list[float]], metric: str, *, ax: Any = None
) -> Figure:
    """A group x step heatmap, step names along x, groups along y."""
    import numpy
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(
            figsize=(max(4.0, 0.7 * len(names) + 3), max(2.5, 0.28 * len(groups) + 1.2)),
            layout="constrained",
        )
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    data = numpy.array(values, dtype=float).reshape(len(groups), len(names))
    positive = data[numpy.isfinite(data) & (data > 0)]
    norm = (
        LogNorm(positive.min(), positive.max())
        if positive.size and (numpy.nanmin(data) > 0 and positive.max() > positive.min())
        else None
    )
    image = ax.imshow(data, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize="small")
    ax.set_yticks(range(len(groups)), groups, fontsize="small")
    ax.set_title(metric)
    fig.colorbar(image, ax=ax)
    return fig
