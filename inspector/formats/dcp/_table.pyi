from typing import Any

from inspector.entry import Entry

def storage_by_key(
    storage_data: dict, /
) -> tuple[dict[str, dict[tuple | None, Any]], set[str]]: ...
def entries(
    table: dict,
    by_key: dict,
    sizes: dict,
    planner: dict | None,
    problems: dict[str, str],
    consts: tuple,
    /,
) -> list[Entry | None]: ...
def shared_chunk_lists(table: dict, tensor_metadata: type, /) -> dict[Any, Any]: ...
def items_fit(entries: list[Entry], safetensors: set[str], zstd_ratio: int, /) -> bool | None: ...
