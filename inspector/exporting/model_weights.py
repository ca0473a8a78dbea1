"""A checkpoint's model weights as the architecture adapters (:mod:`.hf`) see them, for the
``hf`` and ``dcp`` exports: keyed by model FQN (component prefix and wrapper segments such
as ``_orig_mod.`` gone), FP8-handled (:mod:`.fp8`) before any transform, and read one
source tensor at a time; plus the HF config and asset files those exports use."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import posixpath
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from inspector import dtypes
from inspector.errors import ExportError, UsageError
from inspector.exporting import plan as planning
from inspector.exporting.fp8 import Output as Fp8Output
from inspector.formats.base import bytes_view, parse_json
from inspector.formats.writing import Item
from inspector.keys.spellings import WRAPPER_PREFIXES, model_fqn, strip_segments

if TYPE_CHECKING:
    import torch

    from inspector.checkpoint import Checkpoint
    from inspector.entry import Entry
    from inspector.exporting import hf
    from inspector.storage.base import ByteRange

ADAPTED_FP8_MODES = ("dequantize", "unwrap")  # "keep" writes scales no HF model loads
# an hf folder also quantizes: it reads dequantized, then splits the adapter's outputs
HF_FP8_MODES = (*ADAPTED_FP8_MODES, "quantize")
CONFIG_NAME = "config.json"
HfConfig = Mapping[str, Any] | str | os.PathLike | None
_MAX_CONFIG_BYTES = 1 << 24  # model configs are kilobytes; a bigger "config" is not one
# Files of an assets folder that are weights (or their index), never copied as assets.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".npz",
    ".onnx",
    ".index.json",
)


class ModelWeights:
    """The model tensors of ``ck`` under their FQNs; ``skipped``: stored key -> why left out.

    :meth:`item` makes the writer's Item for one adapter output; items read their source
    through a one-tensor cache, so outputs that share a source (the experts of a stack) and
    come in a row read it once.
    """

    def __init__(
        self,
        ck: Checkpoint,
        fp8: str,
        dtype: str | None,
        modes: tuple[str, ...] = ADAPTED_FP8_MODES,
    ) -> None:
        if fp8 not in modes:
            raise UsageError(
                f"fp8 must be one of {', '.join(modes)} for a model-folder export, "
                f"not {fp8!r}"
            )
        self.ck, self.cast = ck, dtype
        self.skipped: dict[str, str] = {}
        tensors = []
        for entry in ck.entries():
            if entry.component != "model":
                self.skipped[entry.key] = f"{entry.component}: not a model weight"
            elif entry.kind != "tensor":
                self.skipped[entry.key] = "not a tensor"
            else:
                tensors.append(entry.key)
        mode = "dequantize" if fp8 == "quantize" else fp8
        found, consumed = planning.outputs(ck, tensors, mode, dtype, "fail")
        self.skipped |= consumed
        self.outputs: dict[str, Fp8Output] = {}
        self._keys: dict[str, str] = {}
        for output in found:
            fqn = strip_segments(model_fqn(ck.entry(output.name)) or output.name, WRAPPER_PREFIXES)
            if fqn in self.outputs:
                raise ExportError(
                    f"{self._keys[fqn]!r} and {output.name!r} are both the model weight {fqn!r}",
                    key=output.name,
                )
            self.outputs[fqn], self._keys[fqn] = output, output.name
        self._held: tuple[tuple[str, int | None], torch.Tensor] | None = None

    def metas(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """FQN -> (shape, dtype name) as FP8 handling produces them: what the adapters plan
        from (names, so planning imports no torch)."""
        return {
            fqn: (tuple(o.shape or ()), o.dtype or "float32") for fqn, o in self.outputs.items()
        }

    def read(self, fqn: str, index: int | None = None) -> torch.Tensor:
        """The weight (or its slice ``index`` of the leading axis), FP8-handled; the last one
        read is kept until another is asked for."""
        if self._held is None or self._held[0] != (fqn, index):
            self._held = None  # let it go before the next one is read
            self._held = ((fqn, index), self._read(fqn, index))
        return self._held[1]

    def _read(self, fqn: str, index: int | None) -> torch.Tensor:
        output = self.outputs[fqn]
        if index is None:
            return output.read()
        if output.conversion is None and output.name == self._keys[fqn]:
            return read_slice(self.ck, output.name, index)
        return output.read()[index]

    def release(self) -> None:
        """Drop the tensor the cache holds (after writing, after verifying)."""
        self._held = None

    def stored(self, fqn: str) -> str:
        """The stored key of the weight ``fqn``."""
        return self._keys[fqn]

    def cast_to(self, output: hf.Output) -> str | None:
        """The dtype ``output`` is cast to (only high-precision values are), or None."""
        stored = dtypes.name_of(output.dtype)
        if self.cast and self.cast != stored and stored in dtypes.HIGH_PRECISION:
            return self.cast
        return None

    def item(self, output: hf.Output) -> Item:
        """The Item writing ``output``: stored bytes copied as they are where nothing changes."""
        from inspector.exporting.hf import transforms

        cast = self.cast_to(output)
        dtype = cast or dtypes.name_of(output.dtype)
        produce = functools.partial(_produce, self, output, cast)
        fp8 = self.outputs[output.source]
        plain = (
            output.transform is transforms.copy
            and output.index is None
            and fp8.conversion is None
            and not cast
        )
        key = self._keys[output.source]
        ranges = functools.partial(self.ck.byte_ranges, key) if plain and fp8.name == key else None
        if not plain and not cast and fp8.name == key and fp8.conversion is None:
            ranges = functools.partial(slice_bytes, self.ck, key, output.index, output.transform)
        return Item(output.name, dtype, output.shape, produce, ranges)

    def conversion(self, output: hf.Output) -> str | None:
        """How ``output`` is made from its stored source, in words (None: a plain copy)."""
        from inspector.exporting.hf import transforms

        cast = self.cast_to(output)
        parts = [
            self.outputs[output.source].conversion,
            None if output.index is None else f"slice {output.index} of the stacked layers",
            transforms.describe(output.transform),
            f"cast to {cast}" if cast else None,
        ]
        text = "; ".join(p for p in parts if p)
        return f"{self._keys[output.source]}: {text}" if text else None


def slice_bytes(
    ck: Checkpoint, key: str, index: int | None, transform: object = None
) -> list[ByteRange] | None:
    """Where slice ``index`` of the leading axis (the whole tensor for None), or the blocks
    of it ``transform`` picks (an expert, a row range, a QKV part's rows in each query
    group, a trimmed vocabulary) lies as contiguous plain bytes of stored chunks (a Megatron
    layer, or expert, at TP=1), so it is copied, not read; else None."""
    from inspector.exporting.hf import transforms

    entry = ck.entry(key)
    shape = tuple(entry.shape or ())
    lead = () if index is None else (index,)
    found = transforms.blocks(transform or transforms.copy, shape[len(lead) :])
    if found is None:
        return None
    itemsize = dtypes.itemsize(entry.dtype or "float32")
    ranges = []
    for start, size in found:
        byte_range = _block_bytes(ck, entry, (*lead, *start), (1,) * len(lead) + size, itemsize)
        if byte_range is None:
            return None
        ranges.append(byte_range)
    return ranges


def _block_bytes(
    ck: Checkpoint, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int
) -> ByteRange | None:
    """The stored bytes of one block (at ``offsets``, of ``sizes``) when it lies contiguous
    in one plain stored chunk; else None."""
    for number, chunk in enumerate(entry.chunks):
        local = [o - c for o, c in zip(offsets, chunk.offsets, strict=True)]
        if all(n >= 0 and n + s <= c for n, s, c in zip(local, sizes, chunk.sizes, strict=True)):
            start = _contiguous_start(local, sizes, tuple(chunk.sizes))
            whole = ck.source.chunk_bytes(entry, number) if start is not None else None
            if whole is None or start is None:
                return None
            length = math.prod(sizes) * itemsize
            crc = whole.crc if length == whole.length else None
            offset = whole.offset + start * itemsize
            return dataclasses.replace(whole, offset=offset, length=length, crc=crc)
    return None


def _contiguous_start(
    local: list[int], sizes: tuple[int, ...], chunk: tuple[int, ...]
) -> int | None:
    """The element offset of a block (at ``local``, of ``sizes``) inside a row-major chunk,
    when the block is contiguous there: ones, then any size, then whole dimensions."""
    wide = next((d for d, size in enumerate(sizes) if size != 1), len(sizes))
    if any(local[d] or sizes[d] != chunk[d] for d in range(wide + 1, len(sizes))):
        return None
    start = 0
    for offset, size in zip(local, chunk, strict=True):
        start = start * size + offset
    return start


def read_slice(ck: Checkpoint, key: str, index: int) -> torch.Tensor:
    """Slice ``index`` of a tensor's leading axis, read from only the chunks that hold it."""
    import torch

    entry = ck.entry(key)
    shape = tuple(entry.shape or ())
    for number, chunk in enumerate(entry.chunks):
        if chunk.offsets[0] == index and tuple(chunk.sizes) == (1, *shape[1:]):
            return ck.read_chunk(key, number)[0]  # the slice is one stored chunk
    out = torch.empty(shape[1:], dtype=dtypes.to_torch(entry.dtype or "float32"))
    filled = 0
    for number, chunk in enumerate(entry.chunks):
        start, size = chunk.offsets[0], chunk.sizes[0]
        if not start <= index < start + size:
            continue
        region = tuple(
            slice(o, o + n) for o, n in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True)
        )
        out[region] = ck.read_chunk(key, number)[index - start]
        filled += out[region].numel()
    if filled != out.numel():
        raise ExportError(f"the stored chunks do not cover slice {index} of the tensor", key=key)
    return out


def _produce(weights: ModelWeights, output: hf.Output, cast: str | None) -> torch.Tensor:
    value = output.transform(weights.read(output.source, output.index))
    return value.to(dtypes.to_torch(cast)) if cast else value


def compare_tied(weights: ModelWeights, pairs: tuple[tuple[str, str], ...]) -> None:
    """Refuse to leave out a tied head whose weights differ from the embedding's."""
    for head, embedding in pairs:
        a, b = (weights.outputs[k].read().contiguous() for k in (head, embedding))
        same = a.shape == b.shape and a.dtype == b.dtype and bytes_view(a) == bytes_view(b)
        if not same:  # bytes, so a NaN equals itself
            raise ExportError(
                f"hf_config tie_word_embeddings is true, but {weights.stored(head)!r} differs "
                f"from {weights.stored(embedding)!r}, which HF would use in its place: pass "
                "tie_word_embeddings=False in hf_config to keep the head",
                key=weights.stored(head),
            )


def load_config(
    hf_config: HfConfig, hf_assets: str | os.PathLike | None, source: Checkpoint | None = None
) -> dict | None:
    """``hf_config`` (a dict, or a config.json path or its folder), else the config.json of
    ``hf_assets``, else the one beside the ``source`` checkpoint (local or remote); None
    when there is none."""
    if hf_assets is not None and not Path(hf_assets).expanduser().is_dir():
        raise ExportError("hf_assets is not a folder", file=hf_assets)
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hf_config is not None:
        path = Path(hf_config).expanduser()
        return _read_config(path / CONFIG_NAME if path.is_dir() else path, "hf_config")
    if hf_assets is not None and (Path(hf_assets).expanduser() / CONFIG_NAME).is_file():
        return _read_config(Path(hf_assets).expanduser() / CONFIG_NAME, "the config")
    return _source_config(source) if source is not None else None


def _source_config(ck: Checkpoint) -> dict | None:
    """The config.json in the folder of what ``ck`` opened, read through its storage (a
    model folder on S3 or the Hub has one too); None when there is none."""
    storage = ck.source.storage
    name = posixpath.join(posixpath.dirname(ck.source.name), CONFIG_NAME)
    if storage.kind(name) != "file":
        return None
    where = storage.describe(name)
    if storage.size(name) > _MAX_CONFIG_BYTES:
        raise ExportError("is larger than any model config; pass hf_config", file=where)
    config = parse_json(storage.read(name), file=where, what="the config")
    if not isinstance(config, dict):
        raise ExportError("the config is not a JSON object", file=where)
    return config


def _read_config(path: Path, argument: str) -> dict:
    try:
        text = read_regular(path, argument, _MAX_CONFIG_BYTES).decode("utf-8")
        config = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"cannot read {argument} ({exc})", file=path) from None
    if not isinstance(config, dict):
        raise ExportError(f"{argument} is not a JSON object", file=path)
    return config


def asset_files(folder: str | os.PathLike | None) -> list[Path]:
    """The files of ``hf_assets`` an HF folder takes along as they are (tokenizer, generation
    config, chat template, README, ...): every top-level file except weights, their index,
    config.json (written from the checked config) and hidden files (checked to be a folder
    by :func:`load_config`). An assets folder is often an untrusted download: an entry that
    links out of it, or is no regular file (a FIFO, a device), is refused by name."""
    if folder is None:
        return []
    root = Path(folder).expanduser().resolve()
    found = []
    for path in sorted(root.iterdir()):
        if path.name == CONFIG_NAME or path.name.startswith(".") or path.name.endswith(
            WEIGHT_SUFFIXES
        ):
            continue
        try:
            real = path.resolve(strict=True)
            mode = real.stat().st_mode
        except (OSError, RuntimeError) as exc:
            raise ExportError(f"hf_assets entry cannot be read ({exc})", file=path) from None
        if root not in real.parents:
            raise ExportError(f"hf_assets entry links outside hf_assets, to {real}", file=path)
        if stat.S_ISREG(mode):
            found.append(path)
        elif not stat.S_ISDIR(mode):
            raise ExportError("hf_assets entry is not a regular file", file=path)
    return found


def copy_asset(asset: Path, target: Path) -> None:
    """Copy an entry of :func:`asset_files` to ``target``, opened so that a FIFO, device or
    link swapped in since it was listed is refused, not followed or waited on."""
    with _opened_regular(asset, "hf_assets entry") as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)


def read_regular(path: Path, argument: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (links inside the path are followed; the file
    must be a regular one, at most ``limit`` bytes)."""
    with _opened_regular(path, argument) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ExportError(f"{argument} is larger than {limit} bytes", file=path)
    return data


def _opened_regular(path: Path, argument: str) -> BinaryIO:
    real = path.resolve()
    if real.parts[1:2] in (("proc",), ("sys",)):
        raise ExportError(f"{argument} is a kernel file ({real}), not a regular file", file=path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ExportError(f"cannot read {argument} ({exc.strerror})", file=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ExportError(f"{argument} is not a regular file", file=path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def refuse_overlap(out: Path, folders: Mapping[str, str | os.PathLike | None]) -> None:
    """Never write into a folder the export reads from (``hf_assets``, say)."""
    target = out.resolve()
    for argument, folder in folders.items():
        if folder is not None and Path(folder).expanduser().resolve() == target:
            raise ExportError(f"output would be written into {argument}", file=out)
