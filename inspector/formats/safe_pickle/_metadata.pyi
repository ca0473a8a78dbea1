from collections.abc import Callable
from typing import Any

from inspector.entry import Entry

def entries(
    data: bytes, file_sizes: Callable[[set[str]], dict[str, Any]], consts: tuple, /
) -> tuple[list[Entry], bool, str | None, str | tuple[str, tuple[str, ...]] | None] | None: ...
