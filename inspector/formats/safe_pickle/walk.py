"""What walking a decoded value as a tree would cost, found once, without recursion.

The unpickler builds any shape without recursing (it is a stack machine), and the memo
lets a few hundred bytes say "this dict holds that one twice", forty levels deep. Code
that walks a decoded value later (flattening keys, repr, materialising tensors, hashing,
a writer's pickler) recurses once per level and visits a shared part once per path to it:
100,000 nested lists end in a RecursionError, 2^40 paths never end, and a part that holds
itself loops. So every decoded value is measured here: how deep it nests, how many nodes
it has as a tree (shared parts counted once per reference), and whether it holds itself.
Each distinct container is looked at once; leaves are skipped by type, in bulk.

Records of known classes (DCP's metadata records, numpy arrays) are leaves: no generic
walker enters them (their reprs are bounded), and the DCP reader reads their fields one by
one, bounding each itself.
"""

from __future__ import annotations

from typing import Any

from inspector.formats.safe_pickle.records import (
    DtypeName,
    FrozenClass,
    Marker,
    StorageRef,
    SubclassRef,
    TensorRef,
    UnknownDtype,
)

_LEAVES = frozenset(
    {int, float, str, bytes, bool, type(None), complex, DtypeName, TensorRef, StorageRef}
    | {UnknownDtype, Marker}
)
_SEQUENCES = frozenset({tuple, list, set, frozenset})


def _parts(item: Any) -> Any:
    """What a container holds (an iterable), or None for anything a walker does not enter."""
    kind = type(item)
    if kind in _SEQUENCES:
        return item
    if isinstance(item, dict):
        return (*item.keys(), *item.values())
    if isinstance(item, (tuple, list, set, frozenset)):
        return item
    if kind is SubclassRef:
        return (item.attrs, item.data)
    if kind is slice:
        return (item.start, item.stop, item.step)
    if isinstance(item, type) or type(kind) is FrozenClass:
        return None
    fields = getattr(item, "__dict__", None)  # placeholders and DCP records
    return fields.values() if isinstance(fields, dict) else None


def walk_problem(value: Any, *, max_depth: int, max_nodes: int) -> str | None:
    """Why walking ``value`` as a tree is not bounded (None when it is): containers nested
    deeper than ``max_depth``, more than ``max_nodes`` nodes, or a container holding
    itself."""
    parts = _parts(value)
    if parts is None:
        return None
    sizes: dict[int, int] = {}  # finished containers: their size as a tree
    path = {id(value)}
    # Each frame: the container, its container parts still to enter, its size so far.
    stack: list[list[Any]] = [[value, *_split(parts)]]
    while stack:
        frame = stack[-1]
        pending = frame[1]
        if not pending:
            stack.pop()
            path.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
                if stack[-1][2] > max_nodes:
                    return f"its shared references expand to more than {max_nodes} values"
            continue
        child = pending.pop()
        if _plain_tuple(child):
            frame[2] += 1 + len(child)
            continue
        known = sizes.get(id(child))
        if known is not None:
            frame[2] += known
            if frame[2] > max_nodes:
                return f"its shared references expand to more than {max_nodes} values"
            continue
        if id(child) in path:
            return "an object refers to itself (a cycle)"
        below = _parts(child)
        if below is None:
            frame[2] += 1
            continue
        if len(stack) >= max_depth:
            return f"its objects nest deeper than {max_depth} levels"
        stack.append([child, *_split(below)])
        path.add(id(child))
    return None


def _split(parts: Any) -> tuple[list[Any], int]:
    """The parts that may be containers, and the size so far (1 + the plain leaves)."""
    inner = [p for p in parts if type(p) not in _LEAVES]
    return inner, 1 + len(parts) - len(inner)


def _plain_tuple(item: Any) -> bool:
    """A tuple of leaves only (the sizes and offsets most of a DCP ``.metadata`` is made of):
    counted where it is met, without a frame of its own."""
    return type(item) is tuple and not [p for p in item if type(p) not in _LEAVES]
