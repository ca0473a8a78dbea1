"""Text of values decoded from untrusted files, bounded: a lying pickle can share or nest
its parts so that a plain ``repr`` would run (or print) forever."""

from __future__ import annotations

from typing import Any


def bounded_repr(value: Any, budget: int = 2000) -> str:
    """A repr of a decoded value that stops at ``budget`` characters, shows a container met
    again on its own path as ``...`` and never walks more than ``budget`` nodes."""
    out: list[str] = []
    size = 0
    stack: list[Any] = [value]
    active: list[int] = []
    nodes = 0
    while stack and size < budget and nodes < budget:
        item = stack.pop()
        nodes += 1
        if isinstance(item, _Close):
            active.pop()
            piece = item.text
        elif type(item) is _Text:
            piece = item
        elif isinstance(item, (dict, list, tuple, set, frozenset)) and type(item) in _BRACKETS:
            if id(item) in active:
                piece = "..."
            else:
                active.append(id(item))
                opening, closing = _BRACKETS[type(item)]
                children: list[Any] = []
                pairs = item.items() if isinstance(item, dict) else ((None, v) for v in item)
                for i, (k, v) in enumerate(pairs):
                    if i:
                        children.append(_Text(", "))
                    if isinstance(item, dict):
                        children += [_Text(_atom(k)), _Text(": ")]
                    children.append(v)
                stack.append(_Close(closing))
                stack.extend(reversed(children))
                piece = opening
        elif hasattr(type(item), "global_name"):  # a safe_pickle placeholder
            piece = f"<{item.global_name} (not loaded)>"
        else:
            piece = _atom(item)
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    return text if not stack and len(text) <= budget else text[:budget] + "..."


class _Text(str):
    __slots__ = ()


class _Close:
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_BRACKETS: dict[type, tuple[str, str]] = {
    dict: ("{", "}"),
    list: ("[", "]"),
    tuple: ("(", ")"),
    set: ("{", "}"),
    frozenset: ("frozenset({", "})"),
}


def _atom(value: Any) -> str:
    """repr of a leaf, bounded: huge ints and strings are cut before they are rendered."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes, bytearray)) and len(value) > 200:
        return repr(value[:200]) + f"... ({len(value)} long)"
    if isinstance(value, (int, float, complex, bool, str, bytes, type(None))):
        return repr(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"<{type(value).__name__} {str(dtype).removeprefix('torch.')} {list(shape)}>"
    return f"<{type(value).__name__}>"


def utf8(text: str) -> bytes:
    """UTF-8 bytes of any ``str``, a lone surrogate included (strings decoded from a pickle
    may hold one), one to one: what every digest of a key or name hashes."""
    return text.encode("utf-8", "surrogatepass")
