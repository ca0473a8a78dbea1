"""Which Adam state belongs to which model parameter, for run health: entries that name the
parameter (torchtitan, torch DCP, Megatron's ``state.exp_avg.<fqn>``), or a plain
``optimizer.state_dict()`` that numbers them (HF Trainer's ``optimizer.pt``, Lightning's
``optimizer_states``), looked at only when no entry names a parameter (a format may show
both: DeepSpeed's flat partitions, and the per-parameter state it rebuilds from them).
A number is paired with a parameter only where the checkpoint says
which one it is: the ``param_names`` torch records for an optimizer built from named
parameters, or a shape only one parameter and one state have. The rest stay unpaired (and
are reported), never guessed from an assumed parameter order.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from inspector import dtypes
from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.errors import InspectorError
from inspector.keys.optimizer import (
    IndexedRef,
    indexed_ref,
    optimizer_ref,
    resolve_optimizer_fqn,
    state_name,
)
from inspector.keys.spellings import canonical_fqn, model_fqn

HYPER = ("lr", "betas", "eps")
SMALL = (*HYPER, "step")  # the values read together (StepObjects)


@dataclass(frozen=True)
class Adam:
    """One parameter's Adam state in one step: ``states`` (exp_avg, exp_avg_sq, step -> key),
    ``hyper`` (lr, betas, eps -> key) and ``values`` (step or hyper-parameters the producer
    keeps once for all parameters, already read)."""

    states: dict[str, str]
    hyper: dict[str, str]
    values: dict[str, Any] = field(default_factory=dict)
    objects: StepObjects | None = field(default=None, compare=False, repr=False)

    def value(self, ck: Checkpoint, name: str) -> Any:
        """``step``, ``lr``, ``betas`` or ``eps``: kept for all, or read from its entry."""
        if name in self.values:
            return self.values[name]
        key = self.states.get(name) if name == "step" else self.hyper.get(name)
        if key is None:
            return None
        if self.objects is not None:
            return self.objects.read(ck, key)
        return _read(ck, key)


class StepObjects:
    """A step's step counters and hyper-parameters, read together on first use
    (``ck.read_objects``: the same ``lr`` in every group decoded once); one by one when that
    read fails, so a damaged one fails only its own parameter."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.values: dict[str, Any] | None = None

    def read(self, ck: Checkpoint, key: str) -> Any:
        if self.values is None:
            try:
                self.values = ck.read_objects(self.keys)
            except InspectorError:
                self.values = {}
        return self.values.pop(key) if key in self.values else _read(ck, key)


def _read(ck: Checkpoint, key: str) -> Any:
    return ck.read_objects([key])[key]


@dataclass(frozen=True)
class Unpaired:
    """Optimizer state kept by parameter number that names no parameter soundly."""

    optimizer: str  # the state dict's key prefix
    count: int
    of: int

    @property
    def message(self) -> str:
        where = self.optimizer or "the optimizer"
        return (
            f"{where}: the Adam state of {self.count} of {self.of} parameters is kept by "
            "number, and nothing in the checkpoint says which parameter each is (no "
            "param_names, shapes shared): their moments are not shown"
        )


@dataclass(frozen=True)
class Pairing:
    """Canonical parameter name -> its Adam state, what could not be paired, and why the
    optimizer's stored entries that cannot be read cannot (``damaged``)."""

    params: dict[str, Adam]
    unpaired: tuple[Unpaired, ...] = ()
    damaged: tuple[str, ...] = ()


def pair_optimizer(ck: Checkpoint) -> Pairing:
    """The Adam state of each model parameter in ``ck`` (see the module's docstring)."""
    entries = ck.entries()
    params = {
        fqn: e
        for e in entries
        if e.kind == "tensor" and (fqn := model_fqn(e)) is not None and _floating(e.dtype)
    }
    found = _named(ck, entries, set(params))
    unpaired: list[Unpaired] = []
    if not found:  # numbered state beside named state is the same state, as stored
        found, unpaired = _indexed(ck, entries, params)
    shared = _common(ck, entries)
    objects = StepObjects(
        [k for a in found.values() for h, k in (*a.hyper.items(), *a.states.items()) if h in SMALL]
    )
    found = {
        name: Adam(a.states, a.hyper, {**shared, **a.values}, objects) for name, a in found.items()
    }
    return Pairing(found, tuple(unpaired), _damaged(ck, entries))


def _damaged(ck: Checkpoint, entries: list[Entry]) -> tuple[str, ...]:
    """The errors of optimizer entries (or of the files the producer keeps it in)."""
    files = [p for p, c in ck.profile.component_files.items() if c == "optimizer"]
    return tuple(
        e.error
        for e in entries
        if e.error
        and (e.component == "optimizer" or any(fnmatch.fnmatchcase(e.key, p) for p in files))
    )


def _named(ck: Checkpoint, entries: list[Entry], fqns: set[str]) -> dict[str, Adam]:
    first = ck.profile.state_first
    found: dict[str, Adam] = {}
    for entry in entries:
        ref = optimizer_ref(entry)
        fqn = resolve_optimizer_fqn(ref, fqns, state_first=first) if ref is not None else None
        if ref is None or fqn is None:
            continue
        adam = found.setdefault(canonical_fqn(fqn), Adam({}, {}))
        target = adam.states if ref.section == "state" else adam.hyper
        target[state_name(ref, fqn, state_first=first)] = entry.key
    return found


def _common(ck: Checkpoint, entries: list[Entry]) -> dict[str, Any]:
    """Step and hyper-parameters the producer keeps once in a common-state object (the step
    as ``state.common_step``, or in each group), each only when every parameter group has the
    same (the groups there do not say which parameters they hold)."""
    name = ck.profile.common_optimizer
    key = next((e.key for e in entries if name and e.key.split("/")[0] == name), None)
    if key is None:
        return {}
    try:
        common = ck.read_object(key)
    except InspectorError:
        return {}
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    while isinstance(optimizer, dict) and "param_groups" not in optimizer:
        optimizer = optimizer.get("optimizer")  # the distributed optimizer nests it once more
    if not isinstance(optimizer, dict):
        return {}
    groups = [g for g in optimizer.get("param_groups") or () if isinstance(g, dict)]
    values = {h: v for h in (*HYPER, "step") if (v := _shared(groups, h)) is not None}
    step = (optimizer.get("state") or {}).get("common_step")
    if step is not None:
        values["step"] = step
    if "step" in values:
        values["step"] = float(values["step"])
    return values


def _shared(groups: list[dict[str, Any]], name: str) -> Any:
    """The groups' ``name``, when they all have the same; else None."""
    seen = {repr(g.get(name)) for g in groups}
    return groups[0].get(name) if groups and len(seen) == 1 else None


@dataclass
class _Numbered:
    """One index-keyed optimizer: state fields by parameter number, group fields by group."""

    states: dict[int, dict[str, Entry]] = field(default_factory=dict)
    groups: dict[int, dict[str, Entry]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Model:
    """The model's floating-point parameters: by canonical name, by a shape only one of them
    has, and how many numbered states have each shape (``shared``)."""

    shapes: dict[str, tuple[int, ...]]
    by_name: dict[str, str]
    by_shape: dict[tuple[int, ...], str]
    shared: Counter[tuple[int, ...] | None]

    @classmethod
    def of(cls, params: dict[str, Entry], shared: Counter[tuple[int, ...] | None]) -> _Model:
        shapes = {fqn: tuple(e.shape or ()) for fqn, e in params.items()}
        count = Counter(shapes.values())
        by_shape = {shape: fqn for fqn, shape in shapes.items() if count[shape] == 1}
        return cls(shapes, {canonical_fqn(f): f for f in shapes}, by_shape, shared)

    def pair(self, recorded: str | None, shape: tuple[int, ...] | None) -> str | None:
        """The parameter a numbered state belongs to: the one torch recorded the name of
        (when its shape agrees), else the one parameter of the one state of that shape."""
        if recorded is not None:
            fqn = self.by_name.get(canonical_fqn(recorded))
            return fqn if fqn is not None and self.shapes[fqn] == shape else None
        if shape is None or self.shared[shape] != 1:
            return None
        return self.by_shape.get(shape)


def _indexed(
    ck: Checkpoint, entries: list[Entry], params: dict[str, Entry]
) -> tuple[dict[str, Adam], list[Unpaired]]:
    optimizers: dict[tuple[object, ...], _Numbered] = {}
    for entry in entries:
        ref = indexed_ref(entry)
        if ref is not None:
            _file(optimizers.setdefault(ref.prefix, _Numbered()), ref, entry)
    shapes = Counter(_shape(f) for o in optimizers.values() for f in o.states.values())
    model = _Model.of(params, shapes)
    found: dict[str, Adam] = {}
    unpaired = []
    for prefix, optimizer in optimizers.items():
        group_of, recorded = _members(ck, optimizer)
        missing = 0
        for index, fields in optimizer.states.items():
            fqn = model.pair(recorded.get(index), _shape(fields))
            if fqn is None:
                missing += 1
                continue
            group = optimizer.groups.get(group_of.get(index, -1), {})
            hyper = {h: group[h].key for h in HYPER if h in group}
            found[canonical_fqn(fqn)] = Adam({n: e.key for n, e in fields.items()}, hyper)
        if missing:
            name = ".".join(str(p) for p in prefix)
            unpaired.append(Unpaired(name, missing, len(optimizer.states)))
    return found, unpaired


def _floating(dtype: str | None) -> bool:
    return dtypes.is_known(dtype) and dtypes.is_floating(str(dtype))


def _file(optimizer: _Numbered, ref: IndexedRef, entry: Entry) -> None:
    side = optimizer.states if ref.section == "state" else optimizer.groups
    side.setdefault(ref.index, {})[ref.name] = entry


def _shape(fields: dict[str, Entry]) -> tuple[int, ...] | None:
    moment = fields.get("exp_avg")
    return tuple(moment.shape) if moment is not None and moment.shape is not None else None


def _members(ck: Checkpoint, optimizer: _Numbered) -> tuple[dict[int, int], dict[int, str]]:
    """Parameter number -> its group, and -> the name torch recorded for it (``param_names``,
    kept when the optimizer was built from ``named_parameters()``)."""
    group_of: dict[int, int] = {}
    recorded: dict[int, str] = {}
    for g, fields in optimizer.groups.items():
        numbers = _list(ck, fields.get("params"))
        names = _list(ck, fields.get("param_names"))
        for i, number in enumerate(numbers):
            if not isinstance(number, int):
                continue
            group_of[number] = g
            if len(names) == len(numbers) and isinstance(names[i], str):
                recorded[number] = names[i]
    return group_of, recorded


def _list(ck: Checkpoint, entry: Entry | None) -> list[Any]:
    if entry is None or entry.kind != "object":
        return []
    try:
        value = ck.read_object(entry.key)
    except InspectorError:
        return []
    return list(value) if isinstance(value, (list, tuple)) else []
