"""Can a training run resume from this checkpoint? Every trained parameter has its optimizer
state, shaped like it; the other training state a resume loads is there.

Judged from the entries, reading no tensor: which parameters the optimizer trains comes
from its per-parameter ``param_groups`` entries (torchtitan's flattened optimizer state) or
its groups' ``params`` lists of FQNs (torch DCP's unflattened one; small objects, read),
else from the parameters that have any state at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inspector import dtypes
from inspector.analysis.findings import Problem
from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.errors import InspectorError
from inspector.formats.producers import UNKNOWN, Producer
from inspector.keys.optimizer import (
    is_param_list,
    optimizer_ref,
    resolve_optimizer_fqn,
    state_name,
)
from inspector.keys.spellings import model_fqn
from inspector.keys.training import (
    ADAM_MOMENTS,
    RESUME_COMPONENTS,
    SCALAR_STATES,
    dataloader_rank,
    expected_states,
    is_train_step,
)

_EXAMPLES = 3


@dataclass
class OptimizerState:
    """The optimizer entries of a checkpoint, by the parameter they belong to."""

    states: dict[str, dict[str, Entry]] = field(default_factory=dict)  # fqn -> name -> entry
    grouped: set[str] = field(default_factory=set)  # fqns named by param_groups entries
    unknown: dict[str, list[str]] = field(default_factory=dict)  # section -> keys


def optimizer_state(
    entries: list[Entry], fqns: set[str], profile: Producer = UNKNOWN
) -> OptimizerState:
    """Sort optimizer entries by parameter (spelled as the producer spells them); those
    naming no model parameter are ``unknown``."""
    found = OptimizerState()
    first = profile.state_first
    for entry in entries:
        ref = optimizer_ref(entry)
        if ref is None:
            continue
        fqn = resolve_optimizer_fqn(ref, fqns, state_first=first)
        if fqn is None:
            found.unknown.setdefault(ref.section, []).append(entry.key)
        elif ref.section == "state":
            found.states.setdefault(fqn, {})[state_name(ref, fqn, state_first=first)] = entry
        else:
            found.grouped.add(fqn)
    return found


def resume_problems(ck: Checkpoint) -> list[Problem]:
    """What stops (or may spoil) resuming training from ``ck``."""
    entries = ck.entries()
    components = ck.components()
    if not any(c in components for c in (*RESUME_COMPONENTS, *ck.profile.resume)):
        return [
            Problem(
                None,
                None,
                "model-only",
                "the checkpoint holds model weights only (a seed checkpoint or an export): "
                "there is no optimizer, scheduler or dataloader state to resume training from",
            )
        ]
    params = {fqn: e for e in entries if e.kind == "tensor" and (fqn := model_fqn(e)) is not None}
    problems = _component_problems(ck, components)
    if "optimizer" in components:
        found = optimizer_state(entries, set(params), ck.profile)
        found.grouped |= _grouped_params(ck, entries, set(params))
        problems += _optimizer_problems(params, found, ck.profile.param_states)
    problems += _dataloader_problems(ck, entries)
    return problems


def _grouped_params(ck: Checkpoint, entries: list[Entry], fqns: set[str]) -> set[str]:
    """The model parameters named by the groups' ``params`` lists (FQNs; lists of indices,
    as a plain ``optimizer.state_dict()`` keeps them, name none)."""
    named: set[str] = set()
    for entry in entries:
        if not is_param_list(entry):
            continue
        try:
            value = ck.read_object(entry.key)
        except InspectorError:
            continue
        if isinstance(value, list):
            named |= {v for v in value if isinstance(v, str) and v in fqns}
    return named


def _component_problems(ck: Checkpoint, components: dict[str, int]) -> list[Problem]:
    """What the producer's resume loads and the checkpoint lacks: an error where the producer
    always writes it (its profile says so), a note where its rules are not known."""
    profile = ck.profile
    held = ", ".join(c for c in components if c != "other")
    if profile.strict:
        kind, why = "missing-component", f"{profile.title} saves it and a resume loads it"
    else:
        kind, why = "absent-component", "a resume may need it (the producer's rules are unknown)"
    problems = [
        Problem(None, None, kind, f"no {name} state beside {held}: {why}")
        for name in profile.resume
        if name not in components
    ]
    step_state = profile.step_state
    if step_state in components and not any(is_train_step(e) for e in ck.entries()):
        problems.append(
            Problem(
                None,
                None,
                "missing-component",
                f"{step_state} has no step: the resume cannot tell which step it continues from",
            )
        )
    return problems


def _optimizer_problems(
    params: dict[str, Entry], found: OptimizerState, param_states: frozenset[str] | None
) -> list[Problem]:
    problems = [
        Problem(
            keys[0],
            None,
            "orphan-state",
            f"{len(keys)} optimizer {section} entries name parameters the model part does not "
            f"have, e.g. {keys[0]!r}: loading it into this model fails or drops them "
            "(ck.consistency() suggests the rename)",
        )
        for section, keys in found.unknown.items()
    ]
    seen = {n for names in found.states.values() for n in names}
    expected = param_states if param_states is not None else expected_states(seen)
    # param_groups entries per FQN (torchtitan's flattened state) say what is trained
    trained = found.grouped or set(found.states)
    untracked = []
    for fqn, param in params.items():
        states = found.states.get(fqn, {})
        missing = sorted(expected - set(states))
        if fqn in trained and missing:
            problems.append(
                Problem(
                    param.key,
                    None,
                    "missing-state",
                    f"parameter {fqn!r} has no optimizer {', '.join(missing)}: a resume "
                    "fails to load it, or restarts its moments from zero",
                )
            )
        elif fqn not in trained and _is_float(param):
            untracked.append(param)
        problems += _shape_problems(fqn, param, states)
    if untracked and expected and not found.grouped:
        shown = ", ".join(repr(e.key) for e in untracked[:_EXAMPLES])
        problems.append(
            Problem(
                untracked[0].key,
                None,
                "no-state",
                f"{len(untracked)} floating-point parameters have no optimizer state at all "
                f"(e.g. {shown}): frozen, buffers, or their state was dropped",
            )
        )
    return problems + _dtype_problems(params, found)


def _shape_problems(fqn: str, param: Entry, states: dict[str, Entry]) -> list[Problem]:
    problems = []
    for name, state in states.items():
        if state.kind != "tensor":
            continue
        if name in ADAM_MOMENTS and state.shape != param.shape:
            why = f"shape {list(state.shape or ())}, the parameter {list(param.shape or ())}"
        elif name in SCALAR_STATES and state.numel != 1:
            why = f"{state.numel} elements, not one"
        else:
            continue
        problems.append(
            Problem(state.key, None, "state-shape", f"optimizer {name} of {fqn!r} has {why}")
        )
    return problems


def _dtype_problems(params: dict[str, Entry], found: OptimizerState) -> list[Problem]:
    """One warning per (moment dtype, parameter dtype) pair where the moments are narrower."""
    narrower: dict[tuple[str, str], list[str]] = {}
    for fqn, states in found.states.items():
        param = params.get(fqn)
        if param is None or not _is_float(param):
            continue
        for name, state in states.items():
            if name in ADAM_MOMENTS and _is_float(state) and _narrower(state, param):
                narrower.setdefault((str(state.dtype), str(param.dtype)), []).append(fqn)
    problems = []
    for (moment, weight), fqns in narrower.items():
        shown = ", ".join(repr(f) for f in list(dict.fromkeys(fqns))[:_EXAMPLES])
        problems.append(
            Problem(
                params[fqns[0]].key,
                None,
                "dtype",
                f"optimizer moments are {moment} next to {weight} parameters "
                f"({len(set(fqns))} parameters, e.g. {shown}): updates smaller than {moment} "
                "resolves are lost; intended only with a low-precision optimizer",
            )
        )
    return problems


def _dataloader_problems(ck: Checkpoint, entries: list[Entry]) -> list[Problem]:
    ranks = sorted({r for e in entries if (r := dataloader_rank(e)) is not None})
    if not ranks:
        return []
    lacking = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if not lacking:
        return []
    return [
        Problem(
            None,
            None,
            "dataloader-ranks",
            f"dataloader states for data-parallel ranks {ranks} but not {lacking}: those ranks "
            "would restart their data from the beginning (or fail to load)",
        )
    ]


def _is_float(entry: Entry) -> bool:
    return entry.dtype is not None and dtypes.is_floating(entry.dtype)


def _narrower(a: Entry, b: Entry) -> bool:
    return dtypes.itemsize(a.dtype or "") < dtypes.itemsize(b.dtype or "")
