"""The base of stand-ins that pickle creates and then gives their state: records of the
fields a class pickled, read-only once built, never the class itself."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from inspector.formats.safe_pickle.records import FrozenClass
from inspector.reprs import bounded_repr

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Built(metaclass=FrozenClass):
    """Created by NEWOBJ / REDUCE (its arguments kept in ``args``), then given its state
    once by BUILD (kept in ``state``); after that nothing about it can change."""

    __slots__ = ("args", "state")
    global_name = "?"
    args: tuple[Any, ...]
    state: Mapping[str, Any]

    def __new__(cls, *args: Any) -> Built:
        obj = object.__new__(cls)
        object.__setattr__(obj, "args", args)
        object.__setattr__(obj, "state", _EMPTY)
        return obj

    def __init__(self, *args: Any) -> None:
        """Everything was kept by ``__new__``; REDUCE calls the class, which runs this too."""

    def __setstate__(self, state: Any) -> None:
        if self.state is not _EMPTY:
            raise TypeError(f"{self.global_name} stand-in was given state twice")
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__ state, __slots__ state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ValueError(f"{self.global_name} state is a {type(state).__name__}, not fields")
        object.__setattr__(self, "state", MappingProxyType(dict(state)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} stand-in is immutable")

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"{type(self).__name__} stand-in is immutable")

    def __reduce__(self) -> Any:
        raise TypeError(f"stand-in for {self.global_name} cannot be pickled")

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and self.args == other.args
            and dict(self.state) == dict(other.state)
        )

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        parts = [bounded_repr(a, 200) for a in self.args]
        parts += [f"{k}={bounded_repr(v, 200)}" for k, v in self.state.items()]
        return f"<{self.global_name}({', '.join(parts)})>"[:2000]
