"""What one unpickling may build: about as much as the pickle itself holds.

The opcodes of a pickle cost bytes, so the objects they build directly are bounded by its
size. An allow-listed call is not: a memoised argument can be handed to ``list``, ``bytes``
or ``bytes(n)`` again and again for a few bytes each, and every call copies or allocates
anew. Each such call charges what it is about to build (elements or bytes) against the
budget of the unpickling in progress (a context variable: the stand-ins themselves stay
shared and immutable), before building it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# A genuine pickle copies each thing it holds at most a few times (a bytearray made from
# an encoded string); the slack covers tiny pickles.
_FACTOR = 4
_SLACK = 1 << 20


class Budget:
    """Elements and bytes the allow-listed calls of one unpickling may still build."""

    def __init__(self, pickle_bytes: int) -> None:
        self.limit = _FACTOR * pickle_bytes + _SLACK
        self.left = self.limit

    def charge(self, amount: int, what: str) -> None:
        if amount > self.left:
            raise ValueError(
                f"{what} would build more than a pickle of its size could ever need "
                f"(its calls may build {self.limit} elements or bytes in all)"
            )
        self.left -= amount


_current: ContextVar[Budget | None] = ContextVar("unpickling_budget", default=None)


@contextmanager
def budget(pickle_bytes: int) -> Iterator[Budget]:
    """The budget of an unpickling of a pickle of ``pickle_bytes`` bytes, while it runs."""
    found = Budget(pickle_bytes)
    token = _current.set(found)
    try:
        yield found
    finally:
        _current.reset(token)


def charge(amount: int, what: str) -> None:
    """Charge ``amount`` to the unpickling in progress (ValueError past its budget)."""
    found = _current.get()
    if found is None:
        raise RuntimeError("a pickle stand-in was called outside an unpickling")
    found.charge(amount, what)
