"""Health's numbers for one tensor at one step in one pass over its values.

The values are read in blocks of whole rows (``BLOCK`` elements) and every number health
reports is taken from a block, a cache-sized part at a time, while it is there: sum of squares,
min / max, zeros, NaN / Inf, per-row and per-column max |w|, the update from the step before,
its sum of squares and its dot product with the update before. Memory is streamed about
twice, not once per number, and holds two tensors of the parameter (its values and its last
update, carried to the next step) plus the blocks. A block's numbers come from one call to
``_health.c`` (sums in float64); where it was not built, from torch ops on the block (sums in
float32 within a block, float64 across blocks: relative error ~1e-7).

A local tensor whose bytes are plain (``ck.byte_ranges``) is read straight into the block
buffer with ``readinto``; anything else (a remote run: ranged requests; an assembled or
converted tensor; a damaged one, whose error ``ck.read`` words) is read whole with ``ck.read``
and walked in the same blocks, so the numbers are the same either way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from inspector import dtypes
from inspector.checkpoint import Checkpoint
from inspector.errors import CorruptCheckpointError, InspectorError
from inspector.formats.base import bytes_view
from inspector.storage.base import ByteRange

_health: ModuleType | None
try:
    from inspector.analysis import _health
except ImportError:  # installed without a C compiler: torch takes the same numbers
    _health = None
BLOCK = 1 << 18  # elements per read: 1 MiB of float32 (_health.c takes 256 KiB at a time)


@dataclass(frozen=True)
class Carried:
    """What a parameter carries to the next step: its values as stored (flat float32), the
    update into this step (non-finite values as 0; None at its first step) and their norms."""

    shape: tuple[int, ...]
    weights: torch.Tensor
    update: torch.Tensor | None
    l2: float
    update_l2: float | None


@dataclass(frozen=True)
class WeightNumbers:
    """One parameter's numbers at one step (over its finite values; ``rows`` and
    ``columns``: each row's and column's max |w|, for a matrix)."""

    l2: float
    nan: int
    inf: int
    zeros: int
    absmax: float
    rows: torch.Tensor | None
    columns: torch.Tensor | None
    update_l2: float | None
    update_dot: float | None  # with the update before


@dataclass(frozen=True)
class MomentNumbers:
    """Sums of squares of exp_avg, exp_avg_sq and the effective step (None without ``eps``),
    over the finite values; exp_avg_sq's zeros."""

    numel: int
    m_squares: float
    v_squares: float
    v_zeros: int
    step_squares: float | None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread: block-sized operations only lose to thread wake-ups (parallel
    work comes from worker processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Workspace:
    """The memory a health run works in (carried values and updates, read blocks), named
    and reused from tensor to tensor, grown to the largest: tensors made afresh for each
    leave freed memory resident in the allocator, and peak memory past two tensors."""

    def __init__(self) -> None:
        self._memory: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``numel`` values of ``dtype`` in the memory named ``name``, holding what its last
        use left; earlier takes of ``name`` share it (or, once it grew, are let go)."""
        size = max(numel * dtype.itemsize, 1)
        memory = self._memory.get(name)
        if memory is None or memory.numel() < size:
            self._memory.pop(name, None)  # freed before its successor is made
            memory = self._memory[name] = torch.empty(size, dtype=torch.uint8)
        return memory[: numel * dtype.itemsize].view(dtype)


def weights(
    ck: Checkpoint, key: str, carried: Carried | None, workspace: Workspace
) -> tuple[WeightNumbers, Carried]:
    """The numbers of ``key``'s values, and against ``carried`` (the step before, when of the
    same shape); the values carried on are kept in ``workspace``. On an error, drop
    ``carried``."""
    values = _Values.of(ck, key)
    shape, numel = values.shape, math.prod(values.shape)
    before = carried if carried is not None and carried.shape == shape else None
    if before is None:
        kept, update = workspace.take("values", numel), None
    else:
        kept, update = before.weights, before.update
        if update is None:
            update = workspace.take("updates", numel).zero_()
    size = _block_size(shape)
    tally = _WeightTally(shape, before is not None, min(size, max(numel, 1)), workspace)
    blocks = values.blocks(size, workspace, "weights")
    tally.walk(blocks, kept, update, before is not None and before.update is not None)
    numbers = tally.numbers(before)
    return numbers, Carried(shape, kept, update, numbers.l2, numbers.update_l2)


def moments(
    ck: Checkpoint, m_key: str, v_key: str, eps: float | None, workspace: Workspace
) -> MomentNumbers:
    """exp_avg's and exp_avg_sq's numbers, read side by side, and the sum of squares of
    m / (√v + ``eps``) (the effective step up to a factor the caller applies)."""
    m_values, v_values = _Values.of(ck, m_key), _Values.of(ck, v_key)
    numel = math.prod(v_values.shape)
    if math.prod(m_values.shape) != numel:
        raise CorruptCheckpointError(
            f"exp_avg holds {math.prod(m_values.shape)} values, exp_avg_sq {numel}",
            file=ck.location,
            key=m_key,
        )
    m_sq = v_sq = step_sq = 0.0
    zeros = 0
    size = min(BLOCK, numel)
    scratch, products = workspace.take("scratch", size), workspace.take("products", size)
    m_blocks = m_values.blocks(BLOCK, workspace, "exp_avg")
    for m, v in zip(m_blocks, v_values.blocks(BLOCK, workspace, "exp_avg_sq"), strict=True):
        n = v.numel()
        if _health is not None:
            a, b, z, s = _health.moments(
                bytes_view(m), bytes_view(v), n, eps or 0.0, eps is not None
            )
            m_sq, v_sq, zeros, step_sq = m_sq + a, v_sq + b, zeros + z, step_sq + s
            continue
        m_sq += _finite_squares(m, products[:n])
        v_sq += _finite_squares(v, products[:n])
        zeros += _zeros(v, float(v.amin()))
        if eps is not None:
            s = torch.sqrt(v, out=scratch[:n]).add_(eps)
            s = torch.div(m, s, out=s)
            step_sq += _finite_squares(s, products[:n])
    return MomentNumbers(numel, m_sq, v_sq, zeros, step_sq if eps is not None else None)


class _WeightTally:
    """The running sums of one parameter's blocks."""

    def __init__(
        self, shape: tuple[int, ...], with_update: bool, size: int, workspace: Workspace
    ) -> None:
        self.matrix = len(shape) == 2 and min(shape) >= 2
        self.rows = torch.zeros(shape[0]) if self.matrix else None
        self.columns = torch.zeros(shape[1]) if self.matrix else None
        self.width = shape[1] if self.matrix else 1
        self.squares = self.absmax = 0.0
        self.nan = self.inf = self.zeros = 0
        self.update_squares = 0.0 if with_update else None
        self.update_dot = 0.0
        self.scratch = workspace.take("scratch", size)
        self.products = workspace.take("products", size)

    def walk(
        self,
        blocks: Iterator[torch.Tensor],
        kept: torch.Tensor,
        update: torch.Tensor | None,
        has_update: bool,
    ) -> None:
        """Tallies ``blocks`` (the parameter in order) and, with ``update`` (the update
        before, when ``has_update``), their update from ``kept``; ``kept`` becomes the
        values and ``update`` their update."""
        if _health is not None:
            self._walk_in_c(blocks, kept, update, 0 if update is None else 2 if has_update else 1)
            return
        start = 0
        for block in blocks:
            end = start + block.numel()
            self.add(block, start // self.width)
            if update is not None:
                self.add_update(block, kept[start:end], update[start:end], has_update)
            kept[start:end].copy_(block)
            start = end

    def _walk_in_c(self, blocks: Iterator[torch.Tensor], kept: torch.Tensor,
                   update: torch.Tensor | None, mode: int) -> None:  # fmt: skip
        """``walk`` by _health.c, one call per block (``mode``: see there)."""
        assert _health is not None
        kept_view, update_view = bytes_view(kept), update if update is None else bytes_view(update)
        rows, columns = (None if t is None else bytes_view(t) for t in (self.rows, self.columns))
        width = self.width
        start = 0
        for block in blocks:
            n = block.numel()
            numbers = _health.weights(
                bytes_view(block), n, kept_view, update_view, start, mode, width, rows,
                start // width, columns,
            )  # fmt: skip
            squares, nan, inf, zeros, absmax, update_squares, update_dot = numbers
            self.squares += squares
            self.nan, self.inf, self.zeros = self.nan + nan, self.inf + inf, self.zeros + zeros
            self.absmax = max(self.absmax, absmax)
            if self.update_squares is not None:
                self.update_squares += update_squares
                self.update_dot += update_dot
            start += n

    def add(self, block: torch.Tensor, first_row: int) -> None:
        n = block.numel()
        squares = _squares(block, self.products[:n])
        if not math.isfinite(squares):
            self.nan += int(torch.isnan(block).sum())
            self.inf += int(torch.isinf(block).sum())
            block = torch.nan_to_num(block, 0.0, 0.0, 0.0)
            squares = _exact_squares(block)
        self.squares += squares
        if self.rows is not None and self.columns is not None:
            size = torch.abs(block, out=self.scratch[:n]).view(-1, self.width)
            torch.amax(size, 1, out=self.rows[first_row : first_row + size.shape[0]])
            torch.maximum(self.columns, size.amax(0), out=self.columns)
            self.zeros += _zeros(block, float(size.amin()))
        elif n:
            low, high = (float(x) for x in torch.aminmax(block))
            self.absmax = max(self.absmax, high, -low)
            self.zeros += _zeros(block, low if low > 0 else -high)

    def add_update(
        self, block: torch.Tensor, before: torch.Tensor, update: torch.Tensor, has_update: bool
    ) -> None:
        """``update`` (the update before, when ``has_update``) becomes ``block - before``."""
        n = block.numel()
        now = torch.sub(block, before, out=self.scratch[:n])
        squares = _squares(now, self.products[:n])
        if not math.isfinite(squares):
            now.nan_to_num_(0.0, 0.0, 0.0)
            squares = _exact_squares(now)
        assert self.update_squares is not None
        self.update_squares += squares
        if has_update:
            dot = _dot(now, update, self.products[:n])
            self.update_dot += dot if math.isfinite(dot) else _exact_dot(now, update)
        update.copy_(now)

    def numbers(self, before: Carried | None) -> WeightNumbers:
        if self.rows is not None:
            self.absmax = float(self.rows.max())
        update_l2 = math.sqrt(self.update_squares) if self.update_squares is not None else None
        with_dot = before is not None and before.update is not None
        return WeightNumbers(
            l2=math.sqrt(self.squares),
            nan=self.nan,
            inf=self.inf,
            zeros=self.zeros,
            absmax=self.absmax,
            rows=self.rows,
            columns=self.columns,
            update_l2=update_l2,
            update_dot=self.update_dot if with_dot else None,
        )


def _zeros(block: torch.Tensor, smallest: float) -> int:
    """How many values are 0, counted only when ``smallest`` (a lower bound of the |values|
    found in a pass made anyway) is not above 0: ``count_nonzero`` is a slow pass."""
    if smallest > 0:
        return 0
    return block.numel() - int(torch.count_nonzero(block))


def _finite_squares(a: torch.Tensor, products: torch.Tensor) -> float:
    """``a · a`` over the finite elements."""
    squares = _squares(a, products)
    if math.isfinite(squares):
        return squares
    return _exact_squares(torch.nan_to_num(a, 0.0, 0.0, 0.0))


def _squares(a: torch.Tensor, products: torch.Tensor) -> float:
    """``a · a`` as ``_dot`` sums it (``square`` makes the same products as ``mul``, in
    half its time)."""
    return float(torch.square(a, out=products).sum())


def _dot(a: torch.Tensor, b: torch.Tensor, products: torch.Tensor) -> float:
    """``a · b`` by torch's cascade sum of the products (~1e-8 relative; ``torch.dot``'s
    BLAS loses up to ~1e-5 on a block)."""
    return float(torch.mul(a, b, out=products).sum())


def _exact_squares(block: torch.Tensor) -> float:
    return _exact_dot(block, block)


def _exact_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """In float64: products that overflow float32 stay finite."""
    return float(torch.dot(a.double(), b.double()))


def _block_size(shape: tuple[int, ...]) -> int:
    """Whole rows of a matrix (at least one), else ``BLOCK`` elements."""
    if len(shape) != 2 or not shape[1]:
        return BLOCK
    return max(1, BLOCK // shape[1]) * shape[1]


# --- reading in blocks ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Values:
    """A tensor to walk in blocks: its plain local byte ranges, or its value read whole."""

    ck: Checkpoint
    key: str
    shape: tuple[int, ...]
    ranges: list[ByteRange] | None
    value: torch.Tensor | None

    @classmethod
    def of(cls, ck: Checkpoint, key: str) -> _Values:
        ranges = _plain_ranges(ck, key)
        if ranges is not None:
            return cls(ck, key, tuple(ck.entry(key).shape or ()), ranges, None)
        value = ck.read(key)  # a logical weight's shape may be known only once read
        return cls(ck, key, tuple(value.shape), None, value)

    def blocks(self, size: int, workspace: Workspace, name: str) -> Iterator[torch.Tensor]:
        """The values in row-major order as float32 blocks of ``size`` elements (the last
        shorter), read into ``workspace``'s memory ``name``; a block is valid until the next
        one is asked for."""
        if self.value is not None:
            flat = self.value.reshape(-1)
            for start in range(0, flat.numel(), size):
                yield flat[start : start + size].to(torch.float32)
            return
        assert self.ranges is not None
        stored = dtypes.to_torch(self.ck.entry(self.key).dtype or "")
        buffer = workspace.take(f"{name} read", min(size, max(math.prod(self.shape), 1)), stored)
        converted = workspace.take(name, buffer.numel()) if stored != torch.float32 else None
        raw, filled = bytes_view(buffer), 0
        for r in self.ranges:
            with r.storage.window(r.name, r.offset, r.length) as window:
                done = 0
                while done < r.length:
                    want = min(len(raw) - filled, r.length - done)
                    got = window.readinto(raw[filled : filled + want])
                    if not got:
                        raise CorruptCheckpointError(
                            f"{r.storage.describe(r.name)} ended while reading",
                            file=self.ck.location,
                            key=self.key,
                        )
                    done, filled = done + got, filled + got
                    if filled == len(raw):
                        yield _float(buffer, converted, buffer.numel())
                        filled = 0
        if filled:
            yield _float(buffer, converted, filled // buffer.element_size())


def _float(buffer: torch.Tensor, converted: torch.Tensor | None, n: int) -> torch.Tensor:
    if converted is None:
        return buffer[:n]
    return converted[:n].copy_(buffer[:n])


def _plain_ranges(ck: Checkpoint, key: str) -> list[ByteRange] | None:
    """The local files' byte ranges that are the tensor's bytes, when they are plain and all
    there (else None: ``ck.read`` reads it, or says what is wrong)."""
    entry = ck.entry(key)
    if not ck.is_local or entry.error or entry.kind != "tensor" or key in ck.logical:
        return None
    try:
        ranges = ck.byte_ranges(key)
        if ranges is None or any(r.offset + r.length > r.storage.size(r.name) for r in ranges):
            return None
    except InspectorError:
        return None
    return ranges
