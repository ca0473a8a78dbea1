"""_health.c against a plain-Python reference: every block length up to ``LONGEST`` (the
vector loops' tails) and two past its sub-block, matrices of each width that divides it, the
three update modes, NaN, Inf, -0.0, subnormal and overflowing values; then calls it must
refuse (short, misaligned, read-only or overlapping buffers, sizes out of range). Run in the
test suite and, under ASan and UBSan, by tests/native/test_sanitized.py
(``python -m tests.native.health_cases``).
"""

from __future__ import annotations

import math
import random
import sys
from array import array
from collections.abc import Callable, Iterator

from inspector.analysis import _health

LONGEST = 40
SUB_BLOCK = 1 << 16  # _health.c's
SPECIAL = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 3e38, -3e38)


def f32(values: list[float]) -> array:
    return array("f", values)


def clean(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def values(rng: random.Random, n: int) -> array:
    """Normal values with a special one at a random place, now and then."""
    out = [rng.gauss(0.0, 1.0) for _ in range(n)]
    for _ in range(rng.randrange(3)):
        if n:
            out[rng.randrange(n)] = rng.choice(SPECIAL)
    return f32(out)


def expected_weights(
    x: array, kept: array, update: array, mode: int, width: int, matrix: bool
) -> tuple:
    """What weights() returns, and kept, update, rows and columns after it."""
    w = [clean(v) for v in x]
    now = f32([0.0] * len(x))
    now[:] = f32([a - b for a, b in zip(x, kept, strict=True)])  # float32 subtraction
    now = f32([clean(v) for v in now])
    rows = [max((abs(v) for v in w[r * width : (r + 1) * width]), default=0.0) for r in
            range(len(x) // width)] if matrix else []  # fmt: skip
    columns = [max((abs(w[i]) for i in range(c, len(w), width)), default=0.0) for c in
               range(width)] if matrix else []  # fmt: skip
    numbers = (
        sum(v * v for v in w),
        sum(math.isnan(v) for v in x),
        sum(math.isinf(v) for v in x),
        sum(v == 0.0 for v in w),
        0.0 if matrix else max((abs(v) for v in w), default=0.0),
        sum(v * v for v in now) if mode else 0.0,
        sum(a * b for a, b in zip(now, update, strict=True)) if mode == 2 else 0.0,
    )
    return numbers, list(x), list(now) if mode else list(update), rows, columns


def expected_moments(m: array, v: array, eps: float) -> tuple:
    e = f32([eps])[0]
    root = f32([math.sqrt(b) if b >= 0 else math.nan for b in v])
    denominator = f32([r + e for r in root])
    step = f32([0.0] * len(m))
    for i, (a, d) in enumerate(zip(m, denominator, strict=True)):
        step[i] = a / d if d else math.copysign(math.inf, a) if a else math.nan
    return (
        sum(clean(a) ** 2 for a in m),
        sum(clean(b) ** 2 for b in v),
        sum(b == 0.0 for b in v),
        sum(clean(s) ** 2 for s in step),
    )


def close(got: tuple, want: tuple) -> bool:
    return all(
        g == w or (isinstance(w, float) and math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-300))
        for g, w in zip(got, want, strict=True)
    )


def _shapes() -> Iterator[tuple[int, int]]:
    """(n, width): every short block and each width dividing it, then blocks longer than the
    C code's sub-block (a vector, and a matrix whose rows do not divide it)."""
    for n in range(LONGEST + 1):
        for width in [w for w in range(1, n + 1) if n % w == 0] or [1]:
            yield n, width
    yield SUB_BLOCK + 37, 1
    yield 7 * (SUB_BLOCK // 7 + 100), 7


def weight_cases(rng: random.Random) -> Iterator[str]:
    """One failure message per disagreement."""
    for n, width in _shapes():
        for mode in (0, 1, 2):
            matrix = width > 1
            x, kept = values(rng, n), values(rng, n)
            update = f32([clean(v) for v in values(rng, n)])  # as weights() leaves it
            want = expected_weights(x, kept, update, mode, width, matrix)
            rows, columns = f32([0.0] * (n // width)), f32([0.0] * width)
            got = _health.weights(
                    x, n, kept, update if mode else None, 0, mode, width,
                    rows if matrix else None, 0, columns if matrix else None,
                )  # fmt: skip
            after = (list(kept), list(update), list(rows) if matrix else [],
                         list(columns) if matrix else [])  # fmt: skip
            if not close(got, want[0]) or any(
                not _same(a, b) for a, b in zip(after, want[1:], strict=True)
            ):
                yield f"weights n={n} width={width} mode={mode}: {got} != {want[0]}"


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, f32(b), strict=True))  # fmt: skip


def moment_cases(rng: random.Random) -> Iterator[str]:
    for n in (*range(LONGEST + 1), SUB_BLOCK + 3):
        m = values(rng, n)
        v = f32([abs(a) if rng.random() < 0.9 else a for a in values(rng, n)])
        for eps in (1e-8, 0.0):
            got = _health.moments(m, v, n, eps, True)
            want = expected_moments(m, v, eps)
            if not close(got, want):
                yield f"moments n={n} eps={eps}: {got} != {want}"
        if _health.moments(m, v, n, 1e-8, False)[3] != 0.0:
            yield f"moments n={n}: a step without with_step"


SHARED = f32([0.0] * 12)


def _weights(**changes: object) -> Callable[[], object]:
    """weights() on a block of 4 values, with ``changes`` to its arguments."""
    args = {
        "block": f32([1.0] * 4),
        "n": 4,
        "kept": f32([0.0] * 4),
        "update": None,
        "start": 0,
        "mode": 0,
        "width": 1,
        "rows": None,
        "first_row": 0,
        "columns": None,
    }
    args.update(changes)
    return lambda: _health.weights(*args.values())


REFUSED: tuple[Callable[[], object], ...] = (
    _weights(n=5),  # a block shorter than n
    _weights(start=1),  # kept too short
    _weights(mode=1),  # no update
    _weights(mode=2, update=f32([0.0])),  # update too short
    _weights(mode=3, update=f32([0.0] * 4)),
    _weights(width=3, rows=f32([0.0] * 2), columns=f32([0.0] * 3)),  # rows do not divide n
    _weights(width=2, rows=f32([0.0]), columns=f32([0.0] * 2)),
    _weights(width=2, rows=f32([0.0] * 2), first_row=1, columns=f32([0.0] * 2)),
    _weights(width=2, rows=f32([0.0] * 2), columns=f32([0.0])),
    _weights(width=2, rows=f32([0.0] * 2)),  # rows without columns
    _weights(n=-1),
    _weights(start=sys.maxsize),
    _weights(first_row=sys.maxsize, width=2, rows=f32([0.0] * 2), columns=f32([0.0] * 2)),
    _weights(kept=bytes(16)),  # read-only
    _weights(block=memoryview(bytearray(17))[1:]),  # not aligned
    _weights(kept=SHARED, block=memoryview(SHARED)[2:]),  # overlapping
    _weights(mode=1, kept=SHARED, update=memoryview(SHARED)[2:]),
    lambda: _health.moments(f32([1.0]), f32([1.0] * 2), 2, 1e-8, True),
    lambda: _health.moments(f32([1.0]), f32([1.0]), -1, 1e-8, True),
)


def refusal_cases() -> Iterator[str]:
    for i, call in enumerate(REFUSED):
        try:
            call()
        except (ValueError, BufferError, TypeError):
            continue
        yield f"refusal case {i} was accepted"


def failures(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [*weight_cases(rng), *moment_cases(rng), *refusal_cases()]


if __name__ == "__main__":
    found = failures()
    print("\n".join(found[:20]) or "ok")
    sys.exit(1 if found else 0)
