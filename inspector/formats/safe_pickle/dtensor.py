"""What a pickled DTensor names, described: its spec, device mesh, mesh layout and placements
become records of the fields a reader needs (global shape and stride, placements, mesh
shape, the writer's coordinate), never torch objects (nothing of torch.distributed loads).

A DTensor pickles as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor,
dtype, global size, global stride, ...), state)`` whose state holds ``_local_tensor`` (the
rank's shard, a plain tensor) and ``_spec``; it decodes to a SubclassRef with those two
attributes (see :func:`dtensor_parts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from inspector.formats.safe_pickle.built import Built
from inspector.formats.safe_pickle.records import FrozenClass, SubclassRef, TensorRef

DTENSOR = "torch.distributed.tensor.DTensor"


class DTensorClass(metaclass=FrozenClass):
    """``DTensor`` as a pickle names it: the class argument of its rebuild, never built."""

    global_name = DTENSOR

    def __new__(cls, *args: Any) -> DTensorClass:
        raise TypeError("a DTensor is described, never built")


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {value!r}, not a non-negative int")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise ValueError(f"{what} is {type(value).__name__}, not a tuple of ints")
    return tuple(_int(v, what) for v in value)


class Placement(Built):
    """A placement of one mesh dimension: ``kind`` is shard, strided, replicate or partial."""

    kind = "?"

    @property
    def dim(self) -> int:
        return _int(self.state.get("dim"), f"{self.global_name} dim")

    @property
    def split_factor(self) -> int:
        return _int(self.state.get("split_factor"), f"{self.global_name} split_factor")

    def __repr__(self) -> str:
        dim, factor = self.state.get("dim"), self.state.get("split_factor")
        if self.kind == "shard":
            return f"Shard({dim!r})"
        if self.kind == "strided":
            return f"_StridedShard({dim!r}, split_factor={factor!r})"
        return f"{self.kind.capitalize()}()"


class Shard(Placement):
    global_name = "torch.distributed.tensor.placement_types.Shard"
    kind = "shard"


class StridedShard(Placement):
    global_name = "torch.distributed.tensor.placement_types._StridedShard"
    kind = "strided"


class Replicate(Placement):
    global_name = "torch.distributed.tensor.placement_types.Replicate"
    kind = "replicate"


class Partial(Placement):
    global_name = "torch.distributed.tensor.placement_types.Partial"
    kind = "partial"


class FlatLayout(Built):
    """One mesh dimension of a ``_MeshLayout``: its size is the product of ``shape``."""

    global_name = "torch.distributed._mesh_layout._FlatLayout"

    @property
    def size(self) -> int:
        return math.prod(_ints(self.state.get("shape"), "mesh layout shape"))


class MeshLayout(Built):
    global_name = "torch.distributed._mesh_layout._MeshLayout"

    @property
    def sizes(self) -> tuple[int, ...]:
        axes = self.state.get("axes")
        if not isinstance(axes, tuple) or not all(isinstance(a, FlatLayout) for a in axes):
            raise ValueError(f"mesh layout axes are {type(axes).__name__}, not flat layouts")
        return tuple(a.size for a in axes)


class DeviceMesh(Built):
    """The writer's (sub)mesh: its shape, dimension names and the writer's coordinate."""

    global_name = "torch.distributed.device_mesh.DeviceMesh"

    @property
    def shape(self) -> tuple[int, ...]:
        layout = self.state.get("_layout")
        if isinstance(layout, MeshLayout):
            return layout.sizes
        mesh = self.state.get("mesh")  # torch < 2.9 pickles the rank grid itself
        if isinstance(mesh, TensorRef):
            return mesh.shape
        raise ValueError("the device mesh records neither a layout nor a rank grid")

    @property
    def coordinate(self) -> tuple[int, ...]:
        """Where the writing rank sits in the mesh (one index per mesh dimension)."""
        coordinate = self.state.get("_coordinate_on_dim")
        if coordinate is None:
            raise ValueError("the writing rank is not part of the DTensor's mesh")
        return _ints(coordinate, "mesh coordinate")

    @property
    def dim_names(self) -> tuple[str, ...] | None:
        names = self.state.get("_mesh_dim_names", self.state.get("mesh_dim_names"))
        return tuple(str(n) for n in names) if isinstance(names, (tuple, list)) else None


class TensorMeta(Built):
    """``TensorMeta(shape, stride, dtype)``: the global tensor's."""

    global_name = "torch.distributed.tensor._dtensor_spec.TensorMeta"

    @property
    def shape(self) -> tuple[int, ...]:
        return _ints(self.args[0] if self.args else None, "global shape")

    @property
    def stride(self) -> tuple[int, ...]:
        return _ints(self.args[1] if len(self.args) > 1 else None, "global stride")


class ShardOrderEntry(Built):
    """``ShardOrderEntry(tensor_dim, mesh_dims)``: the order mesh dims shard a tensor dim."""

    global_name = "torch.distributed.tensor._dtensor_spec.ShardOrderEntry"

    @property
    def tensor_dim(self) -> int:
        return _int(self.args[0] if self.args else None, "shard order tensor dim")

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return _ints(self.args[1] if len(self.args) > 1 else None, "shard order mesh dims")


class DTensorSpec(Built):
    global_name = "torch.distributed.tensor._dtensor_spec.DTensorSpec"

    @property
    def mesh(self) -> DeviceMesh:
        mesh = self.state.get("mesh")
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"the DTensor spec's mesh is a {type(mesh).__name__}")
        return mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        placements = self.state.get("placements")
        if not isinstance(placements, tuple) or not all(
            isinstance(p, Placement) for p in placements
        ):
            raise ValueError("the DTensor spec's placements are not placement records")
        return placements

    @property
    def tensor_meta(self) -> TensorMeta | None:
        meta = self.state.get("tensor_meta")
        return meta if isinstance(meta, TensorMeta) else None

    @property
    def shard_order(self) -> tuple[ShardOrderEntry, ...]:
        """Explicit shard order entries (empty when the default left-to-right order holds)."""
        order = self.state.get("shard_order")
        if order is None or self.state.get("use_strided_shard_as_shard_order"):
            return ()
        if not isinstance(order, tuple) or not all(isinstance(e, ShardOrderEntry) for e in order):
            raise ValueError("the DTensor spec's shard order is malformed")
        return order


def dtensor_parts(value: Any) -> tuple[TensorRef, DTensorSpec] | None:
    """A decoded DTensor's local shard and spec; None when ``value`` is not a DTensor.
    ValueError when it is one whose parts are malformed."""
    if not isinstance(value, SubclassRef) or value.cls != DTENSOR:
        return None
    local, spec = value.attrs.get("_local_tensor"), value.attrs.get("_spec")
    if not isinstance(local, TensorRef) or not isinstance(spec, DTensorSpec):
        raise ValueError("the DTensor pickle lacks its local tensor or its spec")
    return local, spec


def _named(module: str, classes: Mapping[str, type]) -> dict[tuple[str, str], type]:
    return {(module, name): cls for name, cls in classes.items()}


_SPEC = {"DTensorSpec": DTensorSpec, "TensorMeta": TensorMeta, "ShardOrderEntry": ShardOrderEntry}
_PLACEMENTS = {
    "Shard": Shard,
    "_StridedShard": StridedShard,
    "Replicate": Replicate,
    "Partial": Partial,
    "_Partial": Partial,
}
# Where each class lives, in torch 2.4 and later (older spellings under ``_tensor``).
GLOBALS: dict[tuple[str, str], type] = {
    **_named("torch.distributed.tensor", {"DTensor": DTensorClass}),
    **_named("torch.distributed.tensor._api", {"DTensor": DTensorClass}),
    **_named("torch.distributed._tensor.api", {"DTensor": DTensorClass}),
    **_named("torch.distributed.tensor._dtensor_spec", _SPEC),
    **_named("torch.distributed._tensor.placement_types", {**_SPEC, **_PLACEMENTS}),
    **_named("torch.distributed.tensor.placement_types", {**_SPEC, **_PLACEMENTS}),
    **_named("torch.distributed.device_mesh", {"DeviceMesh": DeviceMesh}),
    **_named("torch.distributed._tensor.device_mesh", {"DeviceMesh": DeviceMesh}),
    **_named(
        "torch.distributed._mesh_layout", {"_MeshLayout": MeshLayout, "_FlatLayout": FlatLayout}
    ),
}
