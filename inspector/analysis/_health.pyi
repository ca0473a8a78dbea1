def weights(
    block: memoryview,
    n: int,
    kept: memoryview,
    update: memoryview | None,
    start: int,
    mode: int,
    width: int,
    rows: memoryview | None,
    first_row: int,
    columns: memoryview | None,
    /,
) -> tuple[float, int, int, int, float, float, float]: ...
def moments(
    m: memoryview, v: memoryview, n: int, eps: float, with_step: bool, /
) -> tuple[float, float, int, float]: ...
