"""Which model parameter an optimizer entry belongs to (``optimizer.state.<fqn>.exp_avg``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from inspector.entry import Entry


@dataclass(frozen=True)
class OptimizerRef:
    """An optimizer entry's reference to a parameter.

    ``fqn`` is exact when the nested path kept it apart (``("optimizer", "state", fqn,
    "exp_avg")``); after DCP's flattening (``"state.<fqn>.exp_avg"``) only ``text``, the
    FQN followed by the state's own name, is known.
    """

    section: str
    text: str
    fqn: str | None

    @property
    def guessed_fqn(self) -> str:
        """The exact FQN, or the text without its last segment (the state's name)."""
        return self.fqn if self.fqn is not None else self.text.rpartition(".")[0]


_OPTIMIZER_SECTIONS = ("state", "param_groups")


def optimizer_ref(entry: Entry) -> OptimizerRef | None:
    """The parameter an optimizer entry belongs to; None when it names none (or by index)."""
    if entry.component != "optimizer":
        return None
    path = entry.nested_path
    if len(path) >= 4 and path[1] in _OPTIMIZER_SECTIONS:
        if not isinstance(path[2], str) or path[2].isdigit():
            return None
        return OptimizerRef(path[1], ".".join(str(p) for p in path[2:]), path[2])
    if len(path) != 2 or not isinstance(path[1], str):
        return None
    section, _, text = path[1].partition(".")
    if section not in _OPTIMIZER_SECTIONS or "." not in text or text.split(".", 1)[0].isdigit():
        return None
    return OptimizerRef(section, text, None)


def resolve_optimizer_fqn(
    ref: OptimizerRef, fqns: set[str] | frozenset[str], *, state_first: bool = False
) -> str | None:
    """The FQN in ``fqns`` the reference names (longest dotted prefix of its text; with
    ``state_first``, Megatron's spelling, the text after the state's name); else None."""
    if ref.fqn is not None:
        return ref.fqn if ref.fqn in fqns else None
    if state_first:
        rest = ref.text.partition(".")[2]
        return rest if rest in fqns else None
    text = ref.text
    while "." in text:
        text = text.rpartition(".")[0]
        if text in fqns:
            return text
    return None


def state_name(ref: OptimizerRef, fqn: str, *, state_first: bool = False) -> str:
    """The state's own name (``exp_avg``, ``step``, ...) once the parameter's FQN is known."""
    if state_first and ref.fqn is None:
        return ref.text.partition(".")[0]
    if ref.fqn is not None:
        return ref.text[len(ref.fqn) + 1 :]
    return ref.text[len(fqn) + 1 :] if ref.text.startswith(fqn + ".") else ref.text


def is_param_list(entry: Entry) -> bool:
    """``optimizer.param_groups.<i>.params``: the parameters one group trains (their FQNs
    where torch DCP's ``get_optimizer_state_dict`` wrote the state unflattened)."""
    if entry.component != "optimizer" or entry.kind != "object":
        return False
    parts = [str(p) for p in entry.nested_path[1:]] or entry.key.split(".")[1:]
    return re.fullmatch(r"param_groups\.\d+\.params", ".".join(parts)) is not None


@dataclass(frozen=True)
class IndexedRef:
    """An entry of a plain ``optimizer.state_dict()``, which names parameters by index:
    ``(*prefix, "state", "<i>", name)`` or ``(*prefix, "param_groups", <g>, name)``
    (``prefix`` tells the optimizers of one checkpoint apart)."""

    prefix: tuple[object, ...]
    section: str
    index: int
    name: str


def indexed_ref(entry: Entry) -> IndexedRef | None:
    """The optimizer, section, index and field of an index-keyed optimizer entry; else None."""
    path = entry.nested_path
    if entry.component != "optimizer" or len(path) < 3:
        return None
    section, index, name = path[-3:]
    if section not in _OPTIMIZER_SECTIONS or not str(index).isdigit() or not isinstance(name, str):
        return None
    return IndexedRef(tuple(path[:-3]), str(section), int(str(index)), name)
