"""Stand-ins for the standard-library classes training scripts pickle into their state:
``argparse.Namespace`` (Megatron's ``args``) and ``signal.Signals`` members. Neither is
built: a namespace becomes a read-only record of its fields, a signal a named number."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Mapping
from typing import Any

from inspector.formats.safe_pickle.built import Built
from inspector.formats.safe_pickle.records import Allowed, Immutable
from inspector.reprs import bounded_repr


class Namespace(Built):
    """``argparse.Namespace`` as pickled (NEWOBJ + BUILD of its ``__dict__``): the fields
    read as attributes (``args.num_layers``) or as a read-only mapping."""

    global_name = "argparse.Namespace"

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> Namespace:
        """A namespace record with these fields (how a reader rebuilds one materialised)."""
        namespace = cls()
        namespace.__setstate__(dict(fields))
        return namespace

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self.state[name]
        except KeyError:
            raise AttributeError(f"the saved namespace has no field {name!r}") from None

    def __getitem__(self, name: str) -> Any:
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def __contains__(self, name: object) -> bool:
        return name in self.state

    @property
    def fields(self) -> Mapping[str, Any]:
        """The namespace's fields, read-only (``vars(args)`` of the saved namespace)."""
        return self.state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and dict(self.state) == dict(other.state)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Namespace({len(self.state)} fields: {bounded_repr(dict(self.state), 400)})"


class EnumMember(Immutable):
    """A member of a standard enum, by class, name and value (e.g. ``signal.Signals.SIGTERM``)."""

    __slots__ = ("cls", "name", "value")
    cls: str
    name: str | None
    value: Any

    def __init__(self, cls: str, name: str | None, value: Any) -> None:
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "value", value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnumMember) and (self.cls, self.value) == (other.cls, other.value)

    def __hash__(self) -> int:
        return hash((self.cls, self.value))

    def __repr__(self) -> str:
        return f"{self.cls}.{self.name}" if self.name else f"{self.cls}({self.value!r})"


def _signal(value: Any) -> EnumMember:
    """``signal.Signals(n)``: a lookup of the number's name (nothing is sent or installed)."""
    if type(value) is not int:
        raise ValueError(f"signal.Signals({value!r}) is not a signal number")
    try:
        name: str | None = signal.Signals(value).name
    except ValueError:
        name = None
    return EnumMember("signal.Signals", name, value)


GLOBALS: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    ("signal", "Signals"): Allowed(_signal, "signal.Signals"),
}
