"""safe_pickle: genuine pickles decode; hostile ones never run and say what they tried."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from inspector.dtypes import name_of
from inspector.errors import CorruptCheckpointError, UnsafeCheckpointError
from inspector.formats import safe_pickle
from inspector.formats.safe_pickle import Opaque, SubclassRef, TensorRef
from tests.hostile import opcodes
from tests.hostile.pickles import Payload, arm, payloads


@pytest.mark.parametrize("name", sorted(payloads(Path("/x"))))
def test_hostile_object_pickle_never_runs(tmp_path: Path, name: str) -> None:
    marker, victim = arm(tmp_path)
    data = pickle.dumps({"lr": 0.1, "evil": payloads(marker)[name]}, protocol=2)
    with pytest.raises(UnsafeCheckpointError, match=r"f\.pkl: key 'k'"):
        safe_pickle.load_data_pickle(data, file="f.pkl", key="k")
    assert not marker.exists()
    assert victim.is_dir()


def test_genuine_metadata_matches_torchs_reader(demo_dir: Path) -> None:
    data = (demo_dir / "flat" / ".metadata").read_bytes()
    ours = safe_pickle.load_metadata(data, file="x")
    theirs = FileSystemReader(str(demo_dir / "flat")).read_metadata()
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    for key, mine in ours.state_dict_metadata.items():
        other = theirs.state_dict_metadata[key]
        assert type(mine).__name__ == type(other).__name__
        if hasattr(other, "chunks"):
            assert (mine.properties.dtype, mine.size) == (
                name_of(other.properties.dtype),
                tuple(other.size),
            )
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in other.chunks
            ]
    mine = {
        (i.fqn, i.offset): (s.relative_path, s.offset, s.length)
        for i, s in ours.storage_data.items()
    }
    other = {
        (i.fqn, None if i.offset is None else tuple(i.offset)): (
            s.relative_path,
            s.offset,
            s.length,
        )
        for i, s in theirs.storage_data.items()
    }
    assert mine == other
    assert str(ours.storage_meta.checkpoint_id) == str(theirs.storage_meta.checkpoint_id)


def test_metadata_refuses_data_classes(tmp_path: Path) -> None:
    meta = Metadata(state_dict_metadata={}, planner_data={"x": io.BytesIO(b"hi")})
    with pytest.raises(UnsafeCheckpointError, match=r"_io\.BytesIO"):
        safe_pickle.load_metadata(pickle.dumps(meta), file="m")


def test_metadata_that_is_not_metadata() -> None:
    with pytest.raises(CorruptCheckpointError, match="not DCP Metadata"):
        safe_pickle.load_metadata(pickle.dumps({"a": 1}), file="m")
    with pytest.raises(CorruptCheckpointError, match="not a well-formed pickle"):
        safe_pickle.load_metadata(pickle.dumps({"a": 1})[:-3], file="m")


SIZE = opcodes.glob("torch", "Size")
NEWOBJ, LIST, STOP = b"\x81", b"l", b"."


def _metadata_with_version(value: bytes) -> bytes:
    """A .metadata pickle: a Metadata record whose ``version`` is ``value`` (records are
    leaves to the walk, so what it holds is only what the unpickler built)."""
    record = opcodes.glob("torch.distributed.checkpoint.metadata", "Metadata")
    state = opcodes.dictionary({"version": value})
    return record + opcodes.EMPTY_TUPLE + NEWOBJ + state + opcodes.BUILD + STOP


def test_metadata_sizes_are_the_pickled_tuples_themselves() -> None:
    """torch.Size(t) in .metadata is ``t`` itself: a memoised 100k-element tuple sized for
    10k chunks is one object (a copy each would be 10^9 elements)."""
    big = opcodes.MARK + opcodes.integer(7) * 100_000 + opcodes.TUPLE + opcodes.put(0) + opcodes.POP
    sizes = opcodes.MARK + opcodes.call(SIZE, opcodes.get(0)) * 10_000 + LIST
    decoded = safe_pickle.load_metadata(_metadata_with_version(big + sizes), file="m")
    assert len(decoded.version) == 10_000 and len(decoded.version[0]) == 100_000
    assert all(size is decoded.version[0] for size in decoded.version)


def test_metadata_size_of_anything_but_a_tuple_is_refused() -> None:
    listed = opcodes.call(SIZE, opcodes.EMPTY_LIST)
    with pytest.raises(CorruptCheckpointError, match="m: cannot decode pickle"):
        safe_pickle.load_metadata(_metadata_with_version(listed), file="m")


class Custom:
    def __init__(self) -> None:
        self.value = 3


def test_unknown_classes_become_inert_placeholders() -> None:
    value = safe_pickle.load_data_pickle(pickle.dumps({"c": Custom()}, protocol=2), file="f")
    placeholder = value["c"]
    assert isinstance(placeholder, Opaque)
    assert placeholder.global_name == f"{__name__}.Custom"
    assert placeholder.state == {"value": 3}
    assert "not loaded" in repr(placeholder)


def test_protocol2_builtins_decode() -> None:
    original = {"b": b"\x00\xffxyz", "s": {1, 2}, "t": (1, 2.5), "n": None, "f": frozenset("ab")}
    assert safe_pickle.load_data_pickle(pickle.dumps(original, protocol=2), file="f") == original


def test_memory_bomb_refused() -> None:
    data = pickle.dumps(Payload(bytearray, 1 << 40), protocol=2)
    with pytest.raises(CorruptCheckpointError, match="larger than any genuine value"):
        safe_pickle.load_data_pickle(data, file="f")


def archive_pickle(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    import zipfile

    return zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]
)
def test_tensor_refs_describe_without_loading(dtype: torch.dtype) -> None:
    tensor = torch.zeros(4, 6, dtype=dtype)[1:, ::2]
    ref = safe_pickle.load_data_pickle(archive_pickle(tensor), file="f")
    assert isinstance(ref, TensorRef)
    assert (ref.dtype, ref.shape, ref.stride, ref.storage_offset) == (
        name_of(dtype),
        (3, 3),
        (6, 2),
        6,
    )
    assert ref.storage.numel == 24


def test_wrapper_subclass_described() -> None:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    f8 = hp_tensor_to_float8_dynamic(torch.randn(8, 16), torch.float8_e4m3fn, LinearMMConfig())
    ref = safe_pickle.load_data_pickle(archive_pickle(f8), file="f")
    assert isinstance(ref, SubclassRef)
    assert ref.cls == "torchao.float8.float8_training_tensor.Float8TrainingTensor"
    assert (ref.dtype, ref.shape) == ("float32", (8, 16))
    assert ref.attrs["_data"].dtype == "float8_e4m3fn"
    assert ref.attrs["_orig_dtype"] == "float32"
    assert isinstance(ref.attrs["_linear_mm_config"], Opaque)


def test_referenced_globals_lists_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    names = safe_pickle.referenced_globals(pickle.dumps(Payload(os.system, f"touch {marker}")))
    assert names == ["posix.system"]
    assert not marker.exists()


# --- plain-data pickles (torch_checkpointing's metadata.pkl): no global of any kind -----------


@pytest.mark.parametrize("name", sorted(payloads(Path("/x"))))
def test_plain_data_refuses_hostile_globals(tmp_path: Path, name: str) -> None:
    marker, victim = arm(tmp_path)
    data = pickle.dumps({"metadata": {}, "evil": payloads(marker)[name]})
    with pytest.raises(UnsafeCheckpointError, match=r"metadata\.pkl: .*plain data only"):
        safe_pickle.load_plain(data, file="metadata.pkl")
    assert not marker.exists() and victim.is_dir()


def test_plain_data_refuses_even_harmless_globals() -> None:
    from collections import OrderedDict

    assert safe_pickle.load_plain(pickle.dumps({"a": [1, (2, None)]}), file="m") == {
        "a": [1, (2, None)]
    }
    with pytest.raises(UnsafeCheckpointError, match=r"collections\.OrderedDict"):
        safe_pickle.load_plain(pickle.dumps(OrderedDict(a=1)), file="m")


# --- stand-ins for what training state pickles: namespaces, signals, DTensor specs ----------

_BUILT_TWICE = (
    b"\x80\x02cargparse\nNamespace\nq\x00)\x81q\x01}q\x02X\x01\x00\x00\x00aK\x01sb"
    b"h\x01}q\x03X\x01\x00\x00\x00aK\x02sb."
)


def test_namespace_is_a_read_only_record() -> None:
    import argparse

    args = safe_pickle.load_data_pickle(
        pickle.dumps(argparse.Namespace(num_layers=2, lr=0.1)), file="f"
    )
    assert type(args).__module__ == "inspector.formats.safe_pickle.stdlib"
    assert (args.num_layers, args["lr"], dict(args.fields)) == (
        2,
        0.1,
        {"num_layers": 2, "lr": 0.1},
    )
    with pytest.raises(TypeError, match="immutable"):
        args.lr = 1.0
    with pytest.raises(CorruptCheckpointError, match="given state twice"):
        safe_pickle.load_data_pickle(_BUILT_TWICE, file="f")


def test_signal_numbers_are_looked_up_and_nothing_else_of_signal() -> None:
    import signal

    value = safe_pickle.load_data_pickle(pickle.dumps(signal.Signals.SIGTERM), file="f")
    assert repr(value) == "signal.Signals.SIGTERM" and value.value == 15
    with pytest.raises(UnsafeCheckpointError, match=r"_signal\.alarm"):
        safe_pickle.load_data_pickle(pickle.dumps(Payload(signal.alarm, 1)), file="f")


def test_dtensor_spec_described_not_built() -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    from inspector.formats.safe_pickle import dtensor

    placements = safe_pickle.load_data_pickle(
        pickle.dumps((Shard(1), _StridedShard(0, split_factor=2), Replicate())), file="f"
    )
    assert [(p.kind, p.dim) for p in placements[:2]] == [("shard", 1), ("strided", 0)]
    assert (placements[1].split_factor, placements[2].kind) == (2, "replicate")
    with pytest.raises(TypeError, match="immutable"):
        placements[0].dim = 3
    with pytest.raises(TypeError, match="described, never built"):
        dtensor.DTensorClass()


def test_the_metadata_stand_ins_can_be_imported_first() -> None:
    """``inspector.formats.dcp.metadata`` before anything else (the policy's table of its
    classes is built on first use, not while the module is half imported)."""
    code = "import inspector.formats.dcp.metadata as m; print(len(m.CLASSES))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 10
