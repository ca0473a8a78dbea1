"""A DeepSpeed ZeRO step folder (``global_stepN/``), read without DeepSpeed.

Entries, in three groups:

- the fp32 master weights, rebuilt as DeepSpeed's ``zero_to_fp32`` rebuilds them (see
  :mod:`.zero`), under their module names (the ``model`` component): buffers, frozen
  parameters, trainable parameters, tied parameters. Reading one reads only its slices of
  each rank's partition, straight into the result.
- the model states (``mp_rank_00_model_states.pt``, under ZeRO 3 rank 0's
  ``zero_pp_rank_0_mp_rank_00_model_states.pt``) under their own keys: ``module.*`` (the
  module's weights as saved: a bf16 copy, or under ZeRO 3 empty placeholders), the
  scheduler, counters, ``param_shapes`` and the rest.
- each rank's optimizer-states file under ``optimizer.rank<R>.``: the flat partitions and
  the base optimizer's state, as saved.

Without optimizer-states files (ZeRO off, or saved without the optimizer) the module's
weights are the model. Every file is a torch.save archive read through the project's
torch.save reader; nothing is unpickled outside safe_pickle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats.base import ChunkValue, Step, StoredRecord, bytes_view
from inspector.formats.deepspeed import files as ds_files
from inspector.formats.deepspeed.zero import (
    PARAM_SHAPES,
    Master,
    Partition,
    Slice,
    complete,
    zero2_masters,
    zero3_masters,
)
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.formats.safe_pickle.stdlib import EnumMember
from inspector.formats.torch_save.reader import TorchSaveSource
from inspector.storage.base import ByteRange, Storage
from inspector.words import counted, inflected

if TYPE_CHECKING:
    import torch

PADDINGS = "param_alignment_paddings"
FORMAT = "deepspeed"
PRODUCER = "deepspeed"
OPTIMIZER_STATE = "optimizer_state_dict"
# Where each stage keeps its flat fp32 partitions in the optimizer states.
FP32_GROUPS = {
    1: "single_partition_of_fp32_groups",
    2: "single_partition_of_fp32_groups",
    3: "fp32_flat_groups",
}
# Where each stage keeps the torch optimizer's own state dict, whose state ``g`` belongs to
# flat partition ``g`` and lies like it (zero_to_fp32's arithmetic places its elements too).
BASE_STATE = {1: "base_optimizer_state", 2: "base_optimizer_state", 3: OPTIMIZER_STATE}
MOMENTS = ("exp_avg", "exp_avg_sq")
HYPER = ("lr", "betas", "eps")
# Components of the model states' top-level keys (the rest: other).
_STATE_COMPONENTS = {
    "lr_scheduler": "lr_scheduler",
    "data_sampler": "dataloader",
    "global_steps": "train_state",
    "global_samples": "train_state",
    "skipped_steps": "train_state",
}


class DeepSpeedSource:
    """A DeepSpeed step folder: model states, optimizer partitions, fp32 master weights."""

    format = FORMAT
    producer = PRODUCER
    name = ""
    nesting = "DeepSpeed's model states, optimizer states per rank, fp32 master weights"
    key_matching = "stored"
    steps: tuple[Step, ...] = ()
    offsets: dict[str, tuple[int, ...]] | None = None

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.metadata: dict[str, str] = {}
        models, optims = ds_files.step_files(storage)
        if not models:
            raise CorruptCheckpointError(
                "no *mp_rank_NN_model_states.pt file: not a DeepSpeed step folder",
                file=storage.location,
            )
        self.source_files = (*models, *optims)
        self.ranks: int | None = len(optims) or len(models)
        self._files: dict[str, TorchSaveSource | str] = {}
        for name in self.source_files:
            try:
                self._files[name] = TorchSaveSource(storage, name)
            except InspectorError as exc:
                self._files[name] = exc.reason
        notes: list[str] = []
        self._layout: _Layout | None = None
        self._masters, master_notes = self._rebuild(models, optims)
        notes.extend(master_notes)
        self._inner: dict[str, tuple[str, Entry]] = {}
        self._entries: dict[str, Entry] = {}
        for master in self._masters.values():
            self._entries[master.name] = self._master_entry(master)
        self._add_adam_state()
        self._add_file(models[0], (), lambda path: _state_component(path, bool(self._masters)))
        for name in optims:
            self._add_file(
                name, ("optimizer", f"rank{ds_files.rank_of(name)}"), lambda path: "optimizer"
            )
        self.notes = (
            f"DeepSpeed step: {counted(len(models), 'model-states file')} and "
            f"{counted(len(optims), 'optimizer-states file')}; "
            f"{counted(len(self._masters), 'fp32 master weight')} rebuilt as zero_to_fp32 does",
            *notes,
        )

    # --- building ---------------------------------------------------------------------
    def _rebuild(self, models: list[str], optims: list[str]) -> tuple[dict[str, Master], list[str]]:
        """The fp32 masters by name (empty when there are no ZeRO partitions) and notes."""
        if not optims:
            return {}, ["no optimizer-states files: the module's weights are the model's"]
        first = self._files[optims[0]]
        if isinstance(first, str):
            return self._failed(models, f"{optims[0]} cannot be read: {first}"), []
        stage = _object(first, f"{OPTIMIZER_STATE}.zero_stage")
        stage = stage.value if isinstance(stage, EnumMember) else stage
        if stage not in FP32_GROUPS:
            return {}, [
                f"{optims[0]} names no ZeRO stage 1-3 (zero_stage: {stage!r}): "
                "no fp32 master weights rebuilt"
            ]
        self.metadata["zero_stage"] = str(stage)
        try:
            state = ds_files.decode(self.storage, models[0])
        except InspectorError as exc:
            return {}, [f"{models[0]} cannot be read: {exc.reason}"]
        label = self.storage.describe(models[0])
        if not isinstance(state, dict):
            return {}, [f"{models[0]} holds no dict of model states"]
        self.metadata.update(_versions(state))
        problem = self._ranks_problem(first, optims)
        shapes = _param_shapes(state.get(PARAM_SHAPES), label)
        if isinstance(shapes, str) or problem:
            return self._failed(models, problem or str(shapes), state), []
        partitions = [self._partitions(name, FP32_GROUPS[stage]) for name in optims]
        broken = next((p for p in partitions if isinstance(p, str)), None)
        if broken is not None:
            return self._failed(models, broken, state), []
        ranks: list[list[Partition]] = partitions  # type: ignore[assignment]
        dtype = self._entry(ranks[0][0]).dtype if ranks[0] else "float32"
        where = f"{label} (with the optimizer-states partitions)"
        if stage == 3:
            trainable = zero3_masters(shapes, ranks, dtype or "float32", where=where)
        else:
            paddings = _paddings(_object(first, f"{OPTIMIZER_STATE}.{PADDINGS}"))
            trainable = zero2_masters(shapes, ranks, dtype or "float32", paddings, where=where)
        self._layout = _Layout(stage, shapes, ranks, paddings if stage != 3 else None, where)
        masters = [*self._buffers(models[0], state), *self._frozen(models, state, stage)]
        masters.extend(trainable)
        return _with_shared(masters, state.get("shared_params")), []

    def _add_adam_state(self) -> None:
        """Each trained parameter's Adam state, rebuilt from the ranks' flat optimizer state
        as its fp32 master is from the flat partitions, under the names a per-parameter
        optimizer state dict uses: ``optimizer.state.<name>.{exp_avg,exp_avg_sq,step}`` and
        ``optimizer.param_groups.<name>.{lr,betas,eps}`` (the step and hyper-parameters are
        its group's)."""
        layout = self._layout
        if layout is None:
            return
        base = (OPTIMIZER_STATE, BASE_STATE[layout.stage])
        for moment in MOMENTS:
            parts = self._state_partitions(layout.ranks, base, moment)
            if parts is None:
                continue
            for master in layout.masters(parts):
                if master.error is None:
                    path = ("optimizer", "state", master.name, moment)
                    self._add_view(dataclasses.replace(master, name=".".join(path)), path)
        owner = layout.ranks[0][0].file if layout.ranks and layout.ranks[0] else None
        if owner is None:
            return
        for group, names in enumerate(layout.shapes):
            for name in names:
                self._add_group_state(owner, base, group, name)

    def _state_partitions(
        self, ranks: Sequence[Sequence[Partition]], base: tuple[str, str], moment: str
    ) -> list[list[Partition]] | None:
        """Each rank's flat ``moment`` per group, as long as its fp32 partition (the state
        may run on into padding); None when a rank lacks it."""
        found = []
        for partitions in ranks:
            mine = []
            for group, part in enumerate(partitions):
                entry = self._inner_entry(part.file, ".".join((*base, "state", str(group), moment)))
                if isinstance(entry, str) or entry.numel < part.numel or entry.dtype != "float32":
                    return None
                mine.append(Partition(part.file, entry.key, part.numel))
            found.append(mine)
        return found

    def _add_group_state(self, owner: str, base: tuple[str, str], group: int, name: str) -> None:
        step = self._inner_entry(owner, ".".join((*base, "state", str(group), "step")))
        if not isinstance(step, str) and step.numel == 1:
            path = ("optimizer", "state", name, "step")
            piece = Slice(owner, step.key, 0, 1)
            self._add_view(Master(".".join(path), step.dtype, (), (piece,)), path)
        source = self._files[owner]
        assert not isinstance(source, str)
        for hyper in HYPER:
            inner = source.entry(".".join((*base, "param_groups", str(group), hyper)))
            if inner is not None and inner.kind == "object":
                path = ("optimizer", "param_groups", name, hyper)
                key = ".".join(path)
                self._inner[key] = (owner, inner)
                self._entries[key] = Entry(key, "object", nested_path=path, component="optimizer")

    def _add_view(self, master: Master, path: tuple[str, ...]) -> None:
        self._masters[master.name] = master
        entry = self._master_entry(master)
        self._entries[master.name] = dataclasses.replace(
            entry, nested_path=path, component="optimizer"
        )

    def _failed(self, models: list[str], problem: str, state: Any = None) -> dict[str, Master]:
        """Masters that cannot be rebuilt, each carrying ``problem`` (named after
        ``param_shapes`` when it can be read; the rest of the folder stays browsable)."""
        if state is None:
            try:
                state = ds_files.decode(self.storage, models[0])
            except InspectorError:
                return {}
        shapes = _param_shapes(state.get(PARAM_SHAPES) if isinstance(state, dict) else None, "")
        if isinstance(shapes, str):
            return {}
        found = {n: s for group in shapes for n, s in group.items()}
        return {n: Master(n, "float32", s, error=problem) for n, s in found.items()}

    def _ranks_problem(self, first: TorchSaveSource, optims: list[str]) -> str | None:
        """Why the optimizer-states files are not one whole set of ranks, or None."""
        count = _object(first, f"{OPTIMIZER_STATE}.partition_count")
        if isinstance(count, list) and count and all(isinstance(c, int) for c in count):
            count = max(count)
        if not isinstance(count, int):
            return f"{optims[0]}: {OPTIMIZER_STATE}.partition_count is {count!r}, not a count"
        ranks = sorted(ds_files.rank_of(n) for n in optims)
        if count != len(optims) or ranks != list(range(count)):
            missing = sorted(set(range(count)) - set(ranks))
            return (
                f"the optimizer states are partitioned over {counted(count, 'rank')} "
                f"({optims[0]}: {OPTIMIZER_STATE}.partition_count) but {len(optims)} "
                f"*_optim_states.pt {inflected(len(optims), 'file is', 'files are')} here"
                + (f"; missing {inflected(len(missing), 'rank')} {missing}" if missing else "")
            )
        unreadable = next((n for n in optims if isinstance(self._files[n], str)), None)
        if unreadable is not None:
            return (
                f"rank {ds_files.rank_of(unreadable)}'s partition file {unreadable} "
                f"cannot be read: {self._files[unreadable]}"
            )
        return None

    def _partitions(self, name: str, groups_key: str) -> list[Partition] | str:
        """The file's flat fp32 partitions in group order, or why they cannot be used."""
        source = self._files[name]
        assert not isinstance(source, str)
        prefix = (OPTIMIZER_STATE, groups_key)
        found = sorted(
            (e.nested_path[2], e)
            for e in source.entries()
            if e.nested_path[:2] == prefix
            and len(e.nested_path) == 3
            and isinstance(e.nested_path[2], int)
        )
        key = ".".join(prefix)
        if not found:
            return f"{self.storage.describe(name)}: no {key} partitions"
        for _, e in found:
            if e.kind != "tensor" or e.error or e.shape is None or len(e.shape) != 1:
                why = e.error or "not a flat tensor"
                return f"{self.storage.describe(name)}: {e.key} cannot be used ({why})"
        return [Partition(name, e.key, e.numel) for _, e in found]

    def _buffers(self, name: str, state: dict) -> list[Master]:
        """Buffers from the model states, floating ones as float32 (zero_to_fp32's rule)."""
        names = state.get("buffer_names") or []
        module = state.get("module")
        if not isinstance(module, dict) or not isinstance(names, (list, tuple, set)):
            return []
        masters = []
        for k, v in module.items():
            if k not in names or not isinstance(v, TensorRef):
                continue
            cast = dtypes.is_floating(v.dtype)
            piece = Slice(name, f"module.{k}", 0, math.prod(v.shape))
            masters.append(Master(k, "float32" if cast else v.dtype, v.shape, (piece,), None, cast))
        return masters

    def _frozen(self, models: list[str], state: dict, stage: int) -> list[Master]:
        """Frozen parameters from ``frozen_param_fragments`` (ZeRO 3: every rank's)."""
        shapes = state.get("frozen_param_shapes")
        if not isinstance(shapes, dict) or not shapes:
            return []
        owners = models if stage == 3 else models[:1]
        masters = []
        for k, shape in shapes.items():
            if not _is_shape(shape):
                continue
            slices, dtype, problem = [], None, None
            for owner in owners:
                entry = self._inner_entry(owner, f"frozen_param_fragments.{k}")
                if isinstance(entry, str):
                    problem = entry
                    break
                dtype = dtype or entry.dtype
                slices.append(Slice(owner, entry.key, 0, entry.numel))
            masters.append(complete(Master(k, dtype, tuple(shape), tuple(slices), problem)))
        return masters

    def _inner_entry(self, name: str, key: str) -> Entry | str:
        source = self._files.get(name)
        if isinstance(source, str):
            return f"{self.storage.describe(name)} cannot be read: {source}"
        entry = source.entry(key) if source is not None else None
        if entry is None or entry.kind != "tensor":
            return f"{self.storage.describe(name)} holds no tensor {key}"
        return entry

    def _entry(self, part: Partition | Slice) -> Entry:
        source = self._files[part.file]
        assert not isinstance(source, str)
        entry = source.entry(part.tensor)
        assert entry is not None
        return entry

    def _master_entry(self, master: Master) -> Entry:
        first = master.slices[0] if master.slices and not master.error else None
        itemsize = dtypes.itemsize(master.dtype or "float32")
        if first is not None:
            chunk = self._entry(first).chunks[0]
            offset = chunk.byte_offset + first.start * itemsize
            where = ChunkInfo(
                (0,) * len(master.shape), master.shape, first.file, offset, master.numel * itemsize
            )
            return Entry(
                master.name, "tensor", master.dtype, master.shape, (where,), (master.name,), "model"
            )
        return Entry(
            master.name,
            "tensor",
            master.dtype or "float32",
            master.shape,
            (),
            (master.name,),
            "model",
            error=master.error or "no stored slices",
        )

    def _add_file(self, name: str, prefix: tuple[str, ...], component: Any) -> None:
        """The file's entries under ``prefix`` (keys already taken by a master are noted)."""
        source = self._files[name]
        if isinstance(source, str):
            key = ".".join(prefix) or name
            self._entries[key] = Entry(
                key,
                "object",
                nested_path=prefix or (name,),
                component=component(prefix),
                error=source,
            )
            return
        for e in source.entries():
            path = (*prefix, *e.nested_path)
            key = ".".join(map(str, path))
            if key in self._entries:
                continue
            self._inner[key] = (name, e)
            self._entries[key] = Entry(
                key, e.kind, e.dtype, e.shape, e.chunks, path, component(path), e.error
            )

    # --- reading ----------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        master = self._masters.get(entry.key)
        if master is not None and entry.key not in self._inner:
            return self._read_master(master, out)
        name, inner = self._inner[entry.key]
        return self._source(name).read_chunk(inner, index, out)

    def _read_master(self, master: Master, out: torch.Tensor | None) -> torch.Tensor:
        import torch

        if master.cast:
            (piece,) = master.slices
            return self._stored(piece).float().reshape(master.shape)
        dtype = dtypes.to_torch(master.dtype or "float32")
        if out is None or out.dtype != dtype or tuple(out.shape) != master.shape:
            out = torch.empty(master.shape, dtype=dtype)
        flat, done = out.view(-1), 0
        for piece in master.slices:
            count = min(piece.count, master.numel - done)
            if count <= 0:
                break
            self._read_slice(piece, flat[done : done + count])
            done += count
        return out

    def _read_slice(self, piece: Slice, dest: torch.Tensor) -> None:
        """Elements ``piece.start`` on of a stored tensor into ``dest``: straight from the
        file when the tensor is plain contiguous bytes, else through a read of it."""
        source, entry = self._source(piece.file), self._entry(piece)
        if entry.error:
            raise CorruptCheckpointError(
                entry.error, file=self.storage.describe(piece.file), key=entry.key
            )
        where = source.chunk_bytes(entry, 0)
        if where is not None and entry.dtype == str(dest.dtype).removeprefix("torch."):
            offset = where.offset + piece.start * dest.element_size()
            self.storage.read_into(piece.file, offset, bytes_view(dest))
            return
        dest.copy_(self._stored(piece).reshape(-1)[piece.start : piece.start + dest.numel()])

    def _stored(self, piece: Slice) -> torch.Tensor:
        import torch

        entry = self._entry(piece)
        value = self._source(piece.file).read_chunk(entry, 0)
        if not isinstance(value, torch.Tensor):
            raise UnsupportedError(
                "a tensor subclass where DeepSpeed saves a plain tensor",
                file=self.storage.describe(piece.file),
                key=entry.key,
            )
        return value

    def _source(self, name: str) -> TorchSaveSource:
        source = self._files[name]
        assert not isinstance(source, str)
        return source

    def read_object(self, entry: Entry) -> Any:
        name, inner = self._inner[entry.key]
        return self._source(name).read_object(inner)

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        if entry.key not in self._inner:
            master = self._masters[entry.key]
            if len(master.slices) != 1 or master.cast:
                return None
            (piece,) = master.slices
            source, inner = self._source(piece.file), self._entry(piece)
            where = source.chunk_bytes(inner, 0)
            if where is None or inner.dtype != master.dtype:
                return None
            start = where.offset + piece.start * dtypes.itemsize(inner.dtype or "")
            return ByteRange(self.storage, piece.file, start, entry.nbytes)
        name, inner = self._inner[entry.key]
        return self._source(name).chunk_bytes(inner, index)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        if entry.key not in self._inner:
            return []
        name, inner = self._inner[entry.key]
        return self._source(name).chunk_globals(inner, index)

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        name, inner = self._inner[entry.key]
        return self._source(name).describe_chunk(inner, index)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Every file's zip records, those of the listed files named after their keys."""
        prefixes: dict[str, tuple[str, ...]] = {name: () for name in self.source_files[:1]}
        prefixes |= {
            name: ("optimizer", f"rank{ds_files.rank_of(name)}")
            for name in self.source_files
            if ds_files.OPTIM_STATES.fullmatch(name)
        }
        for name in self.source_files:
            source = self._files[name]
            if isinstance(source, str):
                size = self.storage.size(name)
                yield StoredRecord(None, name, 0, size, None, "zip archive", source)
                continue
            prefix = prefixes.get(name)
            for record in source.stored_records():
                key = None
                if prefix is not None and record.key is not None:
                    inner = source.entry(record.key)
                    path = (*prefix, *(inner.nested_path if inner else (record.key,)))
                    key = ".".join(map(str, path))
                yield record._replace(key=key)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the ranks' flat partitions make the parameters (what the masters were built by)."""

    stage: int
    shapes: list[dict[str, tuple[int, ...]]]
    ranks: list[list[Partition]]
    paddings: list[list[int]] | None
    where: str

    def masters(self, ranks: list[list[Partition]]) -> list[Master]:
        """The parameters made of ``ranks``' partitions, laid out like the fp32 ones."""
        if self.stage == 3:
            return zero3_masters(self.shapes, ranks, "float32", where=self.where)
        return zero2_masters(self.shapes, ranks, "float32", self.paddings, where=self.where)


def _state_component(path: tuple[Any, ...], masters: bool) -> str:
    head = path[0] if path else ""
    if head == "module":
        return "other" if masters else "model"
    return _STATE_COMPONENTS.get(str(head), "other")


def _object(source: TorchSaveSource, key: str) -> Any:
    """A small non-tensor value of the file (None when absent or unreadable)."""
    entry = source.entry(key)
    if entry is None or entry.kind != "object" or entry.error:
        return None
    try:
        return source.read_object(entry)
    except InspectorError:
        return None


def _versions(state: dict) -> dict[str, str]:
    found = {k: state.get(k) for k in ("ds_version", "global_steps", "dp_world_size")}
    return {k: str(v) for k, v in found.items() if isinstance(v, (str, int))}


def _paddings(value: Any) -> list[list[int]] | None:
    """``param_alignment_paddings`` (per group, per parameter), when kept and well formed."""
    if not isinstance(value, list):
        return None
    if not all(isinstance(g, list) and all(isinstance(n, int) for n in g) for g in value):
        return None
    return value


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(n, int) and n >= 0 for n in value)


def _param_shapes(value: Any, label: str) -> list[dict[str, tuple[int, ...]]] | str:
    """``param_shapes``: one ordered dict of name -> shape per parameter group, or why not."""
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        return f"{label}: {PARAM_SHAPES} is not a list of parameter groups"
    for group in value:
        for name, shape in group.items():
            if not isinstance(name, str) or not _is_shape(shape):
                return f"{label}: {PARAM_SHAPES} gives {name!r} the shape {shape!r}"
    return value


def _with_shared(masters: list[Master], shared: Any) -> dict[str, Master]:
    """The masters by name, tied names (``shared_params``: name -> the name holding the
    data) added as zero_to_fp32 adds them."""
    found = {m.name: m for m in masters}
    if isinstance(shared, dict):
        for name, partner in shared.items():
            if isinstance(name, str) and partner in found:
                source = found[partner]
                found[name] = Master(
                    name, source.dtype, source.shape, source.slices, source.error, source.cast
                )
    return {name: complete(m) for name, m in found.items()}
