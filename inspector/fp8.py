"""Tensor subclasses and FP8: recognise them without running anything, make plain tensors."""

from __future__ import annotations

import torch

from inspector.errors import UnsupportedError
from inspector.safe_pickle import SubclassRef

# Subclasses whose only payload is one inner high-precision tensor, by class name -> attribute.
_WRAPPERS = {
    "WeightWithDynamicFloat8CastTensor": "_tensor",
    "WeightWithDelayedFloat8CastTensor": "_tensor",
    "WeightWithStaticFloat8CastTensor": "_tensor",
    "DTensor": "_local_tensor",
}


def class_name(value: SubclassRef) -> str:
    return value.cls.rsplit(".", 1)[-1]


def to_plain(value: torch.Tensor | SubclassRef) -> torch.Tensor:
    """A plain tensor holding what ``value`` represents (wrappers unwrapped)."""
    while isinstance(value, SubclassRef):
        inner = _WRAPPERS.get(class_name(value))
        if inner is None or not isinstance(value.attrs.get(inner), (torch.Tensor, SubclassRef)):
            raise UnsupportedError(f"cannot convert tensor subclass {value.cls} to a plain tensor")
        value = value.attrs[inner]
    return value
