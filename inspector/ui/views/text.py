"""How sizes, shapes and untrusted text read to a person (shared by the command line and the
Jupyter app)."""

from __future__ import annotations

import io
import re
from typing import Any, TextIO

from inspector.entry import Entry
from inspector.reprs import bounded_repr


def human_bytes(n: int) -> str:
    """Decimal units, like file managers and Hugging Face: 1.5 MB is 1,500,000 bytes."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def shape_text(entry: Entry) -> str:
    """``64x64``, ``scalar`` for a 0-d tensor, ``-`` for a non-tensor value."""
    if entry.shape:
        return "x".join(map(str, entry.shape))
    return "scalar" if entry.kind == "tensor" else "-"


def value_text(value: Any, budget: int = 4000) -> str:
    """A decoded value as text, cut at ``budget`` characters (shared parts and cycles safe)."""
    return bounded_repr(value, budget)


# Characters that would act on a terminal instead of showing: C0 controls but tab and
# newline, DEL, C1 controls (8-bit CSI/OSC), bidi embeddings, overrides and isolates, line
# and paragraph separators, and lone surrogates (unencodable).
_ACTIVE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_text(text: str) -> str:
    """``text`` with every character that would act on a terminal (escape sequences, ``\\r``,
    bidi overrides, NUL, C1 controls, lone surrogates) spelled as a visible escape."""
    return _ACTIVE.sub(_escaped, text)


class TerminalStream(io.TextIOBase):
    """A text stream that writes everything through :func:`terminal_text`: the one point
    where checkpoint-controlled text (keys, metadata, class names, errors) meets a terminal.
    Exact JSON passes unchanged (``json.dump`` writes only printable ASCII and newlines)."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self.inner = inner

    def write(self, text: str) -> int:
        self.inner.write(terminal_text(text))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def writable(self) -> bool:
        return True
