"""What every on-disk format provides once opened, and the file checks they share.

Call order: a format is constructed from a storage and a name (metadata only is read),
then ``entries()``; later, per entry, ``chunk_globals`` / ``describe_chunk`` (a scan:
small pickle records only), ``read_chunk`` / ``read_object`` (the bytes) and
``chunk_bytes`` (where plain bytes lie, for copies); for an audit, ``stored_records``
(where every stored record lies and the checksum its file keeps for it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Union

from inspector.entry import Entry
from inspector.errors import CorruptCheckpointError, InspectorError
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.storage.base import ByteRange, Storage

if TYPE_CHECKING:
    import torch

ChunkValue = Union["torch.Tensor", SubclassRef]


@dataclass(frozen=True, slots=True)
class Step:
    """One saved step of a training run's folder: its folder name, step number (None for
    Megatron's ``release``), where it is, and whether it is the one opened."""

    name: str
    number: int | None
    location: str
    opened: bool = False


class StoredRecord(NamedTuple):
    """One stretch of stored bytes a format vouches for: the entry it belongs to (None: the
    file's own, e.g. a header), where it lies, and the CRC-32 its file keeps for it.

    ``crc32`` is None where the format keeps no checksum (safetensors, pre-1.6 torch.save,
    compressed zip members) and 0 where the writer turned checksums off
    (``torch.serialization.set_crc32_options(False)``). ``what`` describes the bytes for
    messages (``"zip record archive/data/0"``). ``problem`` says why the format cannot vouch
    for them (a damaged archive directory, a header leaving holes); the range is then the
    one the metadata claims, so a missing or short file is still found.
    """

    key: str | None
    file: str
    offset: int
    length: int
    crc32: int | None
    what: str
    problem: str | None = None


class Source(Protocol):
    """One on-disk format, opened: its entries (metadata only) and lazy reads of their data.

    ``storage`` holds the files and ``name`` is what was opened in it (``""``: the folder
    itself). ``producer`` says which program wrote it where the files tell (``"unknown"``
    otherwise), ``ranks`` how many processes wrote it (None when the files do not tell),
    ``nesting`` where entries' nested paths come from (shown with the layout), ``steps``
    the other saved steps of the training run it was opened from (empty otherwise).
    """

    format: str
    producer: str
    storage: Storage
    name: str
    source_files: tuple[str, ...]
    notes: tuple[str, ...]
    metadata: dict[str, str]
    nesting: str
    ranks: int | None
    key_matching: str  # the spelling its own loader matches: "stored" or "flattened"
    steps: tuple[Step, ...]

    def entries(self) -> list[Entry]:
        """Every stored value, in stored order, with ``nested_path`` filled in where known."""
        ...

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        """Chunk ``index`` of a tensor entry: a plain tensor (written into ``out`` when it can)
        or a materialised tensor-subclass description."""
        ...

    def read_object(self, entry: Entry) -> Any:
        """A non-tensor value, decoded through safe_pickle."""
        ...

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        """Where the chunk's row-major bytes lie, when stored as plain contiguous bytes;
        None otherwise (subclass, strided view, compressed)."""
        ...

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        """Classes and functions the chunk's pickle names (read without running it)."""
        ...

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        """The chunk as its pickle describes it (class, dtypes, shapes, attributes), decoded
        through safe_pickle without reading tensor bytes. Detection calls it only for chunks
        whose ``chunk_globals`` name a class outside torch."""
        ...

    def stored_records(self) -> Iterator[StoredRecord]:
        """Every record of the checkpoint's files, for an integrity check: grouped by file and
        in increasing offset within each. Reads only directories and headers (small records),
        one item at a time, so a checkpoint of any size is listed in bounded memory. A
        format without it is audited by its chunks' byte ranges (``chunk_records``)."""
        ...


def chunk_records(source: Source) -> Iterator[StoredRecord]:
    """Records from the entries' chunk byte ranges, without checksums: what an audit checks
    of a format that lists no records of its own (sizes and offsets, not the bytes)."""
    chunks = sorted(
        ((c.file, c.byte_offset, c.byte_length, e.key) for e in source.entries() for c in e.chunks),
        key=lambda item: item[:2],
    )
    for file, offset, length, key in chunks:
        yield StoredRecord(key, file, offset, length, None, "stored bytes")


def file_sizes(storage: Storage, names: set[str], *, referrer: str) -> dict[str, int | str]:
    """Size of each referenced file, or the reason it cannot be used (missing, escaping,
    not a regular file)."""
    sizes: dict[str, int | str] = {}
    for name in names:
        try:
            sizes[name] = storage.size(storage.check(name, referrer=referrer))
        except InspectorError as exc:
            joined = f" {exc.reason}" if exc.reason.startswith("is ") else f": {exc.reason}"
            sizes[name] = f"file {name}{joined}"
    return sizes


def parse_json(
    data: bytes | str,
    *,
    file: str,
    what: str,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """JSON a checkpoint file holds (``what``: a safetensors header, an index); text that is
    not UTF-8, not JSON, or nested past what the parser can recurse through is a
    CorruptCheckpointError naming the file."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError as exc:
        raise CorruptCheckpointError(f"{what} is malformed: nested too deeply", file=file) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        problem = f"{what} is malformed: not valid JSON ({exc})"
        raise CorruptCheckpointError(problem, file=file) from exc


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (any dtype, float8 included)."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() == 1:  # a lone element's stride says nothing (``expand`` makes it 0)
        flat = flat.as_strided((1,), (1,))
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


# --- weights stored in parts (grouped by formats/compressed_tensors.py) ---------------------

MXFP4 = "mxfp4"
FINE_GRAINED_FP8 = "fine-grained-fp8"  # transformers' quant_method fp8 (weight_scale_inv)
# Quantization formats whose stored parts inspector.tensors.packed turns back into values.
QUANT_FORMATS = frozenset(
    [
        "float-quantized",
        "naive-quantized",
        "int-quantized",
        "pack-quantized",
        "nvfp4-pack-quantized",
        MXFP4,
        FINE_GRAINED_FP8,
    ]
)


@dataclass(frozen=True, slots=True)
class Scheme:
    """How one weight was quantized: the storage ``format`` and the weight's quantization
    arguments (``num_bits``, ``type`` int/float, ``strategy`` tensor/channel/group/block/
    tensor_group, ``group_size``, ``block_structure``, ``symmetric``) as config.json has them."""

    format: str
    num_bits: int = 8
    type: str = "int"
    strategy: str = "tensor"
    group_size: int | None = None
    block_structure: tuple[int, ...] | None = None
    symmetric: bool = True

    @property
    def known(self) -> bool:
        """Whether its values can be reconstructed here."""
        return self.format in QUANT_FORMATS

    @property
    def label(self) -> str:
        """``pack-quantized int4 group 128 asymmetric``: what is shown for the weight."""
        if self.format == MXFP4:
            return "mxfp4 e2m1 + e8m0 scale per 32 (gpt-oss)"
        layout = self.strategy
        if self.group_size and self.strategy in ("group", "tensor_group"):
            layout = f"{self.strategy.replace('_', '-')} {self.group_size}"
        elif self.block_structure:
            layout = "block " + "x".join(map(str, self.block_structure))
        text = f"{self.format} {self.type}{self.num_bits} {layout}"
        return text if self.symmetric else text + " asymmetric"

    @classmethod
    def from_args(cls, fmt: str, args: Mapping[str, Any]) -> Scheme:
        block = args.get("block_structure")
        return cls(
            fmt,
            int(args.get("num_bits", 8)),
            str(args.get("type", "int")),
            str(args.get("strategy", "tensor")),
            args.get("group_size"),
            tuple(block) if block else None,
            bool(args.get("symmetric", True)),
        )


@dataclass(frozen=True, slots=True)
class LogicalWeight:
    """One quantized weight: its logical ``key``, ``scheme``, the stored ``parts`` (role ->
    entry key, roles as the producer names them) and its logical dtype and shape when known
    from metadata (a pack-quantized shape is in ``weight_shape``'s values, so None here)."""

    key: str
    scheme: Scheme
    parts: dict[str, str] = field(hash=False)
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
