"""Tensors that repeat their stored values: views with a stride of 0 (``expand``).

``torch.zeros(1).expand(2**31)`` is 4 bytes on disk and 2**31 elements. Reading it gives
the same view (as ``torch.load`` does), but making it dense would allocate 8 GiB. So
statistics, comparison and casts work on the stored values (each counted as often as it
is repeated), iteration goes in blocks that never copy more than a block, and writing one
out dense is refused past ``DENSE_LIMIT`` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

DENSE_LIMIT = 1 << 28  # the most a repeated view may expand to when written out densely


def repeated_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimensions along which the tensor repeats one stored value (stride 0, size > 1)."""
    return tuple(
        d
        for d, (n, s) in enumerate(zip(tensor.shape, tensor.stride(), strict=True))
        if s == 0 and n > 1
    )


def repeats(tensor: torch.Tensor) -> int:
    """How many times each stored value appears in the tensor (1 for a plain tensor)."""
    return math.prod(tensor.shape[d] for d in repeated_dims(tensor))


def stored(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with each repeated dimension cut to its one stored index (size 1 there):
    every value it shows once, the tensor shows ``repeats`` times."""
    for d in repeated_dims(tensor):
        tensor = tensor.narrow(d, 0, 1)
    return tensor


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, keeping a repeated view a view (its stored values cast)."""
    if not repeated_dims(tensor):
        return tensor.to(dtype)
    return stored(tensor).to(dtype).expand(tensor.shape)


def dense_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def flat_blocks(tensor: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """The tensor's elements in row-major order, as contiguous flat blocks of at most
    ``size`` elements (a contiguous tensor's are views; a strided or repeated one's, copies
    of one block each). The blocks depend only on the shape, so two tensors of one shape
    can be walked side by side."""
    if tensor.numel() <= size:
        yield _flat(tensor)
        return
    row = tensor.numel() // tensor.shape[0]
    if row <= size:
        step = size // row
        for start in range(0, tensor.shape[0], step):
            yield _flat(tensor[start : start + step])
        return
    for index in range(tensor.shape[0]):
        yield from flat_blocks(tensor[index], size)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The elements as one contiguous row (a lone element's stride, 0 after ``expand``,
    set to 1, which is all it can mean)."""
    flat = tensor.reshape(-1).contiguous()
    return flat.as_strided((1,), (1,)) if flat.numel() == 1 else flat
