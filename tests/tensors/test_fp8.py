"""FP8 and tensor subclasses: detection from pickles, conversion equal to torchao's own."""

from __future__ import annotations

import hashlib
import io
import json
import math
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import inspector
from inspector import tensors as fp8
from inspector.errors import UnsupportedError
from inspector.exporting.fp8 import FP8_MODES, plan_fp8
from inspector.formats.safe_pickle import SubclassRef
from inspector.formats.torch_archive import TorchArchive
from tests.conftest import run_python
from tests.fixtures import fp8_checkpoints as fx

CONVERTED = [
    f"layers.{i}.{m}.weight"
    for i in range(2)
    for m in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
]
WRAPPER = "WeightWithDynamicFloat8CastTensor"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, -0.0 distinct from 0.0)."""
    return (
        type(a) is torch.Tensor
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def run_without_torchao(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter where ``import torchao`` fails; its last stdout
    line is JSON with a ``torchao`` flag (whether torchao got imported after all)."""
    result = run_python(code, *args, block_torchao=True)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got.pop("torchao") is False
    return got


def dcp_save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return path


# --- real torchao objects saved with torch.save --------------------------------------------


@pytest.fixture(scope="session")
def torchao_objects() -> dict[str, torch.Tensor]:
    objects = fx.payloads(fx.weight())
    objects["nf4"] = fx.nf4_payload(fx.weight(shape=(128, 128)))
    objects["wrapper"] = fx.wrapper(fx.weight(dtype=torch.float32), precomputed=False)
    objects["wrapper_precomputed"] = fx.wrapper(fx.weight(dtype=torch.float32), precomputed=True)
    return objects


@pytest.fixture(scope="session")
def saved_pt(torchao_objects, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pt") / "objects.pt"
    torch.save(torchao_objects, path)
    return path


def via_archive(path: Path) -> tuple[dict, dict]:
    """The saved dict as (described, materialised) values, read by TorchArchive directly."""
    f = open(path, "rb")  # noqa: SIM115  (kept open for the lazy reads below)
    archive = TorchArchive(f, str(path), path.stat().st_size, None)
    described = archive.load()
    return described, {k: archive.materialize(v) for k, v in described.items()}


READERS = [via_archive]

FACTS = {
    "f8_row": ("Float8Tensor", "float8_e4m3fn data + per-row scale", ("scale",)),
    "f8_tensor": ("Float8Tensor", "float8_e4m3fn data + per-tensor scale", ("scale",)),
    "f8_block": ("Float8Tensor", "float8_e4m3fn data + block 32x64 scale", ("scale",)),
    "f8_e5m2_fp32": ("Float8Tensor", "float8_e5m2 data + per-row scale", ("scale",)),
    "train_tensorwise": (
        "Float8TrainingTensor",
        "float8_e4m3fn data + per-tensor scale",
        ("_scale",),
    ),
    "train_rowwise": ("Float8TrainingTensor", "float8_e4m3fn data + per-row scale", ("_scale",)),
    "train_colwise_e5m2": (
        "Float8TrainingTensor",
        "float8_e5m2 data + per-column scale",
        ("_scale",),
    ),
    "mx_e4m3": ("MXTensor", "MX float8_e4m3fn data + e8m0 scale per 32", ("scale",)),
    "mx_e5m2_fp32": ("MXTensor", "MX float8_e5m2 data + e8m0 scale per 32", ("scale",)),
    "mx_fp4": ("MXTensor", "MX fp4_e2m1 data + e8m0 scale per 32", ("scale",)),
    "mx_fp6_e2m3": ("MXTensor", "MX fp6_e2m3 data + e8m0 scale per 32", ("scale",)),
    "mx_fp6_e3m2": ("MXTensor", "MX fp6_e3m2 data + e8m0 scale per 32", ("scale",)),
    "mx_swizzled": ("MXTensor", "MX float8_e4m3fn data + e8m0 scale per 32 (swizzled)", ("scale",)),
    "nvfp4": ("NVFP4Tensor", "NVFP4 fp4_e2m1 data + float8_e4m3fn scale per 16", ("scale",)),
    "nvfp4_two_level": (
        "NVFP4Tensor",
        "NVFP4 fp4_e2m1 data + float8_e4m3fn scale per 16 + per-tensor scale",
        ("scale", "per_tensor_scale"),
    ),
    "nvfp4_swizzled": (
        "NVFP4Tensor",
        "NVFP4 fp4_e2m1 data + float8_e4m3fn scale per 16 (swizzled)",
        ("scale",),
    ),
    "nf4": (
        "NF4Tensor",
        "NF4 data, block 64, int8 scalers per 256",
        ("quantized_scalers", "quantization_factor", "scaler_mean", "nf4"),
    ),
}


FACTS |= {f"{name}_t": FACTS[name] for name in fx.TRANSPOSED}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", sorted(FACTS))
def test_payload_described_from_pickle(saved_pt, reader, name: str) -> None:
    described, _ = reader(saved_pt)
    found = fp8.describe(described[name])
    label, facts, parts = FACTS[name]
    assert (found.kind, found.subclass, found.fp8, found.parts) == ("payload", label, facts, parts)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", sorted(FACTS))
def test_payload_dequantized_like_torchao(torchao_objects, saved_pt, reader, name: str) -> None:
    _, values = reader(saved_pt)
    obj = torchao_objects[name]
    logical = fp8.dequantize(values[name])
    assert same_bits(logical, fx.torchao_dequantized(obj).to(obj.dtype))
    assert same_bits(fp8.to_plain(values[name]), logical)
    if not name.startswith(("train", "nf4")):  # these take no output dtype
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert same_bits(fp8.dequantize(values[name], dtype=dtype), obj.dequantize(dtype))


@pytest.mark.parametrize("reader", READERS)
def test_wrapper_unwraps_to_master_weight(torchao_objects, saved_pt, reader) -> None:
    described, values = reader(saved_pt)
    for name, facts in [
        ("wrapper", "wrapper -> float8_e4m3fn"),
        ("wrapper_precomputed", "wrapper -> float8_e4m3fn, precomputed scale"),
    ]:
        found = fp8.describe(described[name])
        assert (found.kind, found.subclass, found.fp8) == ("wrapper", WRAPPER, facts)
        assert same_bits(fp8.to_plain(values[name]), torchao_objects[name]._tensor)
        assert same_bits(
            fp8.dequantize(values[name], dtype=torch.bfloat16),
            torchao_objects[name]._tensor.bfloat16(),
        )


def test_dequantize_needs_no_torchao(saved_pt: Path, torchao_objects) -> None:
    code = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from tests.tensors.test_fp8 import via_archive\n"
        "from inspector import tensors as fp8\n"
        "described, values = via_archive(Path(sys.argv[1]))\n"
        "out = {k: [fp8.describe(described[k]).fp8,"
        " fp8.dequantize(v).float().double().sum().item()] for k, v in values.items()}\n"
        "print(json.dumps({'torchao': sys.modules.get('torchao') is not None, 'out': out}))\n"
    )
    got = run_without_torchao(code, str(saved_pt))
    _, values = via_archive(saved_pt)
    assert got["out"] == {
        k: [fp8.describe(v).fp8, fp8.dequantize(v).float().double().sum().item()]
        for k, v in values.items()
    }


def test_legacy_float8_tensor_name(tmp_path: Path, torchao_objects) -> None:
    """torchao <= 0.7 pickled Float8TrainingTensor as ``torchao.float8.float8_tensor.Float8Tensor``
    (with its configs in the same module); rewrite a real pickle's GLOBAL lines to those names."""
    buf = io.BytesIO()
    torch.save({"w": torchao_objects["train_rowwise"]}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "legacy.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(
                    b"torchao.float8.float8_training_tensor", b"torchao.float8.float8_tensor"
                ).replace(b"\nFloat8TrainingTensor\n", b"\nFloat8Tensor\n")
            dst.writestr(info.filename, data)
    described, values = via_archive(path)
    assert described["w"].cls == "torchao.float8.float8_tensor.Float8Tensor"
    found = fp8.describe(described["w"])
    assert found.subclass == "Float8Tensor (legacy torchao.float8.float8_tensor)"
    assert found.fp8 == "float8_e4m3fn data + per-row scale"
    want = torchao_objects["train_rowwise"].to_original_precision().bfloat16()
    assert same_bits(fp8.dequantize(values["w"]), want)


class Tagged(torch.Tensor):
    """A storage-backed subclass a user might define (its values are its own storage)."""


class NoStorage(torch.Tensor):
    """A wrapper subclass with no storage of its own: nothing to read without its code."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def _rebuild_reduced(data: torch.Tensor) -> torch.Tensor:
    return data.as_subclass(Reduced)


class Reduced(torch.Tensor):
    """A subclass that pickles through its own rebuild function (not torch's)."""

    def __reduce_ex__(self, protocol):
        return _rebuild_reduced, (self.as_subclass(torch.Tensor),)


def test_unknown_subclasses(tmp_path: Path) -> None:
    values = {
        "tagged": torch.arange(6.0).as_subclass(Tagged),
        "opaque": NoStorage(torch.ones(3)),
        "reduced": torch.ones(2).as_subclass(Reduced),
    }
    torch.save(values, tmp_path / "u.pt")
    described, materialised = via_archive(tmp_path / "u.pt")
    tagged = fp8.describe(described["tagged"])
    assert (tagged.kind, tagged.subclass, tagged.fp8) == (
        "unknown",
        f"{__name__}.Tagged",
        "own storage",
    )
    assert same_bits(fp8.to_plain(materialised["tagged"]), torch.arange(6.0))
    opaque = fp8.describe(described["opaque"])
    assert (opaque.kind, opaque.subclass, opaque.fp8) == ("unknown", f"{__name__}.NoStorage", None)
    with pytest.raises(UnsupportedError, match=r"key 'k'.*NoStorage to a plain tensor"):
        fp8.to_plain(materialised["opaque"], file="u.pt", key="k")
    reduced = fp8.describe(described["reduced"])
    assert (reduced.kind, reduced.subclass) == ("unknown", f"{__name__}._rebuild_reduced")


# --- the demo FSDP2 float8 checkpoint -----------------------------------------------------


def torch_master_weights(path: Path) -> dict[str, torch.Tensor]:
    """What torch's own DCP loader returns (torchao imported): it copies each wrapper's
    master weight into a plain tensor."""
    import torchao.float8  # noqa: F401
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    keys = [*CONVERTED, "output.weight", "tok_embeddings.weight"]
    return dict(_load_state_dict_from_keys(set(keys), checkpoint_id=str(path)))


def test_demo_fp8_detects_exactly_the_converted_linears(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "fp8")
    assert all(ck.facts(k).subclass is None for k in ck.keys())
    ck.scan(progress=False)
    facts = {k: ck.facts(k) for k in ck.keys()}
    marked = {k: (f.subclass, f.fp8) for k, f in facts.items() if f.subclass or f.fp8}
    assert marked == {k: (WRAPPER, "wrapper -> float8_e4m3fn") for k in CONVERTED}
    found = ck.detection("layers.0.attention.wq.weight")
    assert found.kind == "wrapper"
    assert "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor" in found.classes
    assert ck.detection("output.weight") == fp8.Detection("plain")
    table = ck.table().set_index("key")
    assert table.loc["layers.1.feed_forward.w2.weight", "subclass"] == WRAPPER
    assert table.subclass.notna().sum() == len(CONVERTED)


@pytest.mark.parametrize("mode", [m for m in FP8_MODES if m != "quantize"])
def test_demo_fp8_values_are_the_master_weights(demo_dir: Path, mode: str) -> None:
    ck = inspector.open(demo_dir / "fp8")
    masters = torch_master_weights(demo_dir / "fp8")
    outputs, skipped = plan_fp8(ck, list(masters), mode=mode)
    assert skipped == {}
    assert [o.name for o in outputs] == list(masters)
    for out in outputs:
        assert out.sources == (out.name,)
        assert same_bits(out.read(), masters[out.name]), out.name
        assert same_bits(ck.read(out.name), masters[out.name])
        expected = f"unwrap {WRAPPER} -> float32 master weight" if out.name in CONVERTED else None
        assert out.conversion == expected


def test_demo_fp8_without_torchao(demo_dir: Path) -> None:
    code = (
        "import hashlib, json, sys, inspector\n"
        "from inspector.exporting.fp8 import plan_fp8\n"
        "ck = inspector.open(sys.argv[1])\n"
        "ck.scan(progress=False)\n"
        "outs, _ = plan_fp8(ck, [k for k in ck.keys() if ck.entry(k).kind == 'tensor'])\n"
        "digest = {o.name: hashlib.sha256(o.read().numpy().tobytes()).hexdigest() for o in outs}\n"
        "facts = {k: ck.facts(k) for k in ck.keys()}\n"
        "marked = {k: [f.subclass, f.fp8] for k, f in facts.items() if f.subclass}\n"
        "print(json.dumps({'torchao': sys.modules.get('torchao') is not None,"
        " 'marked': marked, 'digest': digest}))\n"
    )
    got = run_without_torchao(code, str(demo_dir / "fp8"))
    assert got["marked"] == {k: [WRAPPER, "wrapper -> float8_e4m3fn"] for k in CONVERTED}
    for key, value in torch_master_weights(demo_dir / "fp8").items():
        assert got["digest"][key] == hashlib.sha256(value.numpy().tobytes()).hexdigest(), key


def test_torch_dcp_to_torch_save_needs_torchao(demo_dir: Path, tmp_path: Path) -> None:
    """The seed problem: torch's own converter cannot even unpickle the chunks without torchao."""
    code = (
        "import sys\n"
        "{prelude}"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    )
    bare = run_python(
        code.format(prelude=""), str(demo_dir / "fp8"), str(tmp_path / "a.pt"), block_torchao=True
    )
    assert bare.returncode != 0
    assert "torchao" in bare.stderr
    assert not (tmp_path / "a.pt").exists()
    with_torchao = run_python(
        code.format(prelude="import torchao.float8\n"),
        str(demo_dir / "fp8"),
        str(tmp_path / "b.pt"),
    )
    assert with_torchao.returncode == 0, with_torchao.stderr
    assert (tmp_path / "b.pt").stat().st_size > 0


def test_scan_is_cached(demo_copy) -> None:
    path = demo_copy("fp8")
    ck = inspector.open(path)
    ck.scan("layers.0.attention.wq.weight", progress=False)
    assert ck.facts("layers.0.attention.wq.weight").subclass == WRAPPER
    assert ck.facts("layers.0.attention.wk.weight").subclass is None
    for shard in path.glob("*.distcp"):
        shard.unlink()
    assert ck.detection("layers.0.attention.wq.weight").kind == "wrapper"
    found = ck.detection("layers.0.attention.wk.weight")
    assert found.kind == "unreadable" and "__0_0.distcp" in found.error


def test_scan_shows_progress(demo_dir: Path, capsys) -> None:
    ck = inspector.open(demo_dir / "fp8")
    ck.scan()
    err = capsys.readouterr().err
    assert "scanning chunks" in err and f"{len(ck)}/{len(ck)}" in err


def test_damaged_chunk_marks_only_its_entry(demo_copy) -> None:
    path = demo_copy("fp8")
    ck = inspector.open(path)
    chunk = ck.entry("layers.1.attention.wv.weight").chunks[1]
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\0" * 4)
    ck.scan(progress=False)
    found = ck.facts("layers.1.attention.wv.weight")
    assert "no torch.save archive" in found.error and found.subclass is None
    assert ck.facts("layers.1.attention.wo.weight").subclass == WRAPPER
    with pytest.raises(inspector.CorruptCheckpointError, match=r"wv\.weight"):
        ck.read("layers.1.attention.wv.weight")


# --- torchao payloads saved by DCP ---------------------------------------------------------

DCP_PAYLOADS = ("f8_row", "f8_block", "mx_e4m3", "mx_fp4", "nvfp4_two_level")


@pytest.fixture(scope="session")
def payload_dcp(torchao_objects, tmp_path_factory) -> Path:
    state = {f"{name}.weight": torchao_objects[name] for name in DCP_PAYLOADS}
    state["norm.weight"] = torch.ones(8)
    return dcp_save(state, tmp_path_factory.mktemp("dcp") / "payloads")


def test_dcp_payloads_detected_and_read(torchao_objects, payload_dcp: Path) -> None:
    ck = inspector.open(payload_dcp)
    ck.scan(progress=False)
    for name in DCP_PAYLOADS:
        entry = ck.entry(f"{name}.weight")
        assert (ck.facts(entry.key).subclass, ck.facts(entry.key).fp8) == FACTS[name][:2]
        assert entry.dtype == "bfloat16"
        obj = torchao_objects[name]
        assert same_bits(ck.read(entry.key), obj.dequantize())
        assert same_bits(ck.read(entry.key, dtype=torch.float32), obj.dequantize(torch.float32))
    assert ck.facts("norm.weight").subclass is None


def test_dcp_payload_plans(torchao_objects, payload_dcp: Path) -> None:
    ck = inspector.open(payload_dcp)
    keys = [f"{n}.weight" for n in DCP_PAYLOADS]
    for mode, dtype in [("dequantize", torch.float32), ("unwrap", torch.bfloat16)]:
        outputs, skipped = plan_fp8(ck, keys, mode=mode, dtype=torch.float32)
        assert skipped == {} and [o.name for o in outputs] == keys
        for out, name in zip(outputs, DCP_PAYLOADS, strict=True):
            assert same_bits(out.read(), torchao_objects[name].dequantize(dtype))
            assert out.conversion == f"{FACTS[name][0]} ({FACTS[name][1]}) -> {str(dtype)[6:]}"
    outputs, _ = plan_fp8(ck, keys, mode="keep")
    got = {o.name: o for o in outputs}
    assert list(got) == [
        "f8_row.weight",
        "f8_row.weight_scale",
        "f8_block.weight",
        "f8_block.weight_scale",
        "mx_e4m3.weight",
        "mx_e4m3.weight_scale",
        "mx_fp4.weight",
        "mx_fp4.weight_scale",
        "nvfp4_two_level.weight",
        "nvfp4_two_level.weight_scale",
        "nvfp4_two_level.weight_per_tensor_scale",
    ]
    for name in DCP_PAYLOADS:
        obj, key = torchao_objects[name], f"{name}.weight"
        assert same_bits(got[key].read(), obj.qdata)
        assert same_bits(got[key + "_scale"].read(), obj.scale)
        assert got[key + "_scale"].sources == (key,)
    assert same_bits(
        got["nvfp4_two_level.weight_per_tensor_scale"].read(),
        torchao_objects["nvfp4_two_level"].per_tensor_scale,
    )
    assert got["f8_row.weight"].conversion == (
        "raw data of Float8Tensor: value = data.float() * scale, repeated over its blocks"
    )


# Block formats beyond DCP_PAYLOADS: NF4 (dcp.save writes it), fp6 MX, swizzled NVFP4.
BLOCK_FORMATS = ("nf4", "mx_fp6_e3m2", "mx_e5m2_fp32", "nvfp4", "nvfp4_swizzled_t")


def test_block_formats_in_dcp_and_torch_checkpointing(torchao_objects, tmp_path: Path) -> None:
    from torch_checkpointing import ItemSpec

    from tests.fixtures.torch_checkpointing import make_manager

    state = {f"{name}.weight": torchao_objects[name] for name in BLOCK_FORMATS}
    manager = make_manager({"model": ItemSpec(), "step": ItemSpec()})
    try:
        manager.save(str(tmp_path / "step_1"), {"model": dict(state), "step": 1})
    finally:
        manager.close()
    for ck, prefix in [
        (inspector.open(dcp_save(dict(state), tmp_path / "dcp")), ""),
        (inspector.open(tmp_path / "step_1"), "model."),
    ]:
        ck.scan(progress=False)
        for name in BLOCK_FORMATS:
            obj, key = torchao_objects[name], f"{prefix}{name}.weight"
            facts = ck.facts(key)
            assert (facts.subclass, facts.fp8) == FACTS[name][:2], (ck.format, name)
            assert facts.scheme == FACTS[name][0]
            assert same_bits(ck.read(key), fx.torchao_dequantized(obj).to(obj.dtype)), name
            if name != "nf4":  # NF4Tensor takes no output dtype
                assert same_bits(ck.read(key, dtype="float32"), obj.dequantize(torch.float32))


@pytest.fixture(scope="session")
def sharded_dcp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    fx.save_sharded(out)
    return out


@pytest.mark.parametrize("name", fx.SHARDED)
def test_two_rank_payload_dequantized_per_chunk(sharded_dcp: Path, name: str) -> None:
    """Each rank quantized its own rows, so each chunk carries its own scales."""
    ck = inspector.open(sharded_dcp / name)
    entry = ck.entry("w")
    assert [c.offsets for c in entry.chunks] == [(0, 0), (32, 0)]
    assert ck.detection("w").subclass == FACTS[name][0]
    halves = [fx.payloads(h)[name] for h in fx.weight().chunk(2)]
    want = torch.cat([fx.torchao_dequantized(h) for h in halves])
    assert same_bits(ck.read("w"), want)
    outputs, _ = plan_fp8(ck, ["w"], mode="dequantize", dtype=torch.float32)
    assert same_bits(outputs[0].read(), torch.cat([h.dequantize(torch.float32) for h in halves]))


def test_two_rank_payload_kept_with_chunk_scales(sharded_dcp: Path) -> None:
    halves = {n: [fx.payloads(h)[n] for h in fx.weight().chunk(2)] for n in fx.SHARDED}
    kept = {}
    for name in fx.SHARDED[:-1]:
        outputs, _ = plan_fp8(inspector.open(sharded_dcp / name), ["w"], mode="keep")
        kept[name] = {o.name: o.read() for o in outputs}
        assert same_bits(kept[name]["w"], torch.cat([h.qdata for h in halves[name]]))
    row, tensor = halves["f8_row"], halves["f8_tensor"]
    assert same_bits(kept["f8_row"]["w_scale"], torch.cat([h.scale for h in row]))
    assert same_bits(kept["f8_tensor"]["w_scale"], torch.cat([h.scale for h in tensor]))
    assert kept["f8_tensor"]["w_scale"].shape == (2, 1)
    assert same_bits(kept["mx_e4m3"]["w_scale"], torch.cat([h.scale for h in halves["mx_e4m3"]]))
    nv = halves["nvfp4_two_level"]
    assert same_bits(kept["nvfp4_two_level"]["w_scale"], torch.cat([h.scale for h in nv]))
    assert same_bits(
        kept["nvfp4_two_level"]["w_per_tensor_scale"],
        torch.stack([h.per_tensor_scale for h in nv]).reshape(2, 1),
    )
    swizzled, _ = plan_fp8(inspector.open(sharded_dcp / "mx_swizzled"), ["w"], mode="keep")
    with pytest.raises(UnsupportedError, match="swizzled scales cannot be kept"):
        swizzled[0].read()
    # A per-tensor scale per row shard is a block scale: block rows 32, all columns.
    dequantized = kept["f8_tensor"]["w"].float() * kept["f8_tensor"]["w_scale"].repeat_interleave(
        32, dim=0
    )
    assert same_bits(dequantized.bfloat16(), torch.cat([h.dequantize() for h in tensor]))


# --- plain float8 stored next to its scales (DeepSeek-V3 / HF / compressed-tensors) --------


def reference_block_dequant(w: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """DeepSeek-V3's rule written out block by block: y[block] = w[block].float() * s[i, j]."""
    out = torch.empty(w.shape, dtype=torch.float32)
    rows, cols = w.shape[-2:]
    for i in range(math.ceil(rows / block)):
        for j in range(math.ceil(cols / block)):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[..., r, c] = w[..., r, c].float() * s[..., i, j].float()[..., None, None]
    return out


def block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight + float32 ``weight_scale_inv`` per ``block`` x ``block`` tile."""
    rows, cols = w.shape[-2:]
    grid = (*w.shape[:-2], math.ceil(rows / block), math.ceil(cols / block))
    scale = torch.empty(grid)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[-2]):
        for j in range(grid[-1]):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            tile = w[..., r, c]
            s = tile.abs().amax(dim=(-2, -1)).clamp(min=1e-12) / 448.0
            scale[..., i, j] = s
            q[..., r, c] = (tile / s.reshape(*s.shape, 1, 1)).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="session")
def scaled_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    dense, dense_scale = block_quantize(torch.randn(300, 200, generator=g))
    experts, experts_scale = block_quantize(torch.randn(3, 130, 260, generator=g))
    rows = torch.randn(48, 32, generator=g)
    row_scale = rows.abs().amax(dim=1, keepdim=True) / 448.0
    whole = torch.randn(16, 16, generator=g)
    return {
        "model.layers.0.mlp.down_proj.weight": dense,
        "model.layers.0.mlp.down_proj.weight_scale_inv": dense_scale,
        "model.layers.0.mlp.experts.gate_up_proj": experts,
        "model.layers.0.mlp.experts.gate_up_proj_scale_inv": experts_scale,
        "model.layers.0.self_attn.q_proj.weight": (rows / row_scale).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale": row_scale,
        "model.layers.0.self_attn.k_proj.weight": (whole / 2).to(torch.float8_e5m2),
        "model.layers.0.self_attn.k_proj.weight_scale": torch.tensor(2.0),
        "model.layers.0.self_attn.v_proj.weight": whole.to(torch.float8_e4m3fn),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
    }


SCALED_FP8 = {
    "model.layers.0.mlp.down_proj.weight": "block 128x128 weight_scale_inv",
    "model.layers.0.mlp.down_proj.weight_scale_inv": "scale of model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj": "block 128x128 gate_up_proj_scale_inv",
    "model.layers.0.mlp.experts.gate_up_proj_scale_inv": (
        "scale of model.layers.0.mlp.experts.gate_up_proj"
    ),
    "model.layers.0.self_attn.q_proj.weight": "per-row weight_scale",
    "model.layers.0.self_attn.q_proj.weight_scale": (
        "scale of model.layers.0.self_attn.q_proj.weight"
    ),
    "model.layers.0.self_attn.k_proj.weight": "per-tensor weight_scale",
    "model.layers.0.self_attn.k_proj.weight_scale": (
        "scale of model.layers.0.self_attn.k_proj.weight"
    ),
    "model.layers.0.self_attn.v_proj.weight": "no scale found",
}


def test_scaled_float8_pairs_recognised_at_open(scaled_state, tmp_path: Path) -> None:
    ck = inspector.open(dcp_save(scaled_state, tmp_path / "scaled"))
    facts = {k: ck.facts(k) for k in ck.keys()}
    assert {k: f.fp8 for k, f in facts.items() if f.fp8} == SCALED_FP8
    assert all(f.subclass is None for f in facts.values())


def test_block_fp8_dequantized_like_deepseek(scaled_state, tmp_path: Path) -> None:
    ck = inspector.open(dcp_save(scaled_state, tmp_path / "scaled"))
    outputs, skipped = plan_fp8(ck, ck.keys(), mode="dequantize", dtype=torch.bfloat16)
    assert skipped == {
        k: f"scale of {k.rsplit('_scale', 1)[0]}, applied to it"
        for k in SCALED_FP8
        if "_scale" in k
    }
    got = {o.name: o for o in outputs}
    dense = "model.layers.0.mlp.down_proj.weight"
    assert got[dense].sources == (dense, dense + "_scale_inv")
    assert got[dense].conversion == "float8_e4m3fn block 128x128 -> bfloat16"
    for key in (dense, "model.layers.0.mlp.experts.gate_up_proj"):
        want = reference_block_dequant(scaled_state[key], scaled_state[key + "_scale_inv"], 128)
        assert same_bits(got[key].read(), want.bfloat16()), key
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    want = scaled_state[q_proj].float() * scaled_state[q_proj + "_scale"]
    assert same_bits(got[q_proj].read(), want.bfloat16())
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert same_bits(got[k_proj].read(), (scaled_state[k_proj].float() * 2).bfloat16())
    v_proj = "model.layers.0.self_attn.v_proj.weight"
    assert got[v_proj].conversion == "float8_e4m3fn -> bfloat16 (no scale found)"
    assert same_bits(got[v_proj].read(), scaled_state[v_proj].bfloat16())
    assert got["model.norm.weight"].conversion is None


@pytest.mark.parametrize("mode", ["unwrap", "keep"])
def test_scaled_float8_left_as_stored(scaled_state, tmp_path: Path, mode: str) -> None:
    ck = inspector.open(dcp_save(scaled_state, tmp_path / "scaled"))
    outputs, skipped = plan_fp8(ck, ck.keys(), mode=mode)
    assert skipped == {}
    assert [o.name for o in outputs] == ck.keys()
    for out in outputs:
        assert out.conversion is None
        assert same_bits(out.read(), scaled_state[out.name])


def test_block_fp8_from_a_safetensors_file(scaled_state, tmp_path: Path) -> None:
    """A DeepSeek-style file written by safetensors itself dequantizes through
    ``inspector.open`` exactly as the DCP copy does (test_block_fp8_dequantized_like_deepseek)."""
    from safetensors.torch import save_file

    save_file(scaled_state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ck = inspector.open(tmp_path / "model.safetensors")
    assert ck.entry("model.layers.0.mlp.down_proj.weight").dtype == "float8_e4m3fn"
    outputs, _ = plan_fp8(ck, ck.keys(), mode="dequantize", dtype=torch.bfloat16)
    got = {o.name: o for o in outputs}
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"):
        assert got[key].conversion == "float8_e4m3fn block 128x128 -> bfloat16"
        want = reference_block_dequant(scaled_state[key], scaled_state[key + "_scale_inv"], 128)
        assert same_bits(got[key].read(), want.bfloat16()), key


def test_block_dequantize_of_plain_tensors() -> None:
    """The public entry point on tensors alone: blocks inferred, or given for other layouts."""
    w, s = block_quantize(torch.randn(300, 200), block=128)
    want = reference_block_dequant(w, s, 128)
    assert same_bits(fp8.dequantize(w, s, dtype=torch.float32), want)
    w64, s64 = block_quantize(torch.randn(200, 200), block=64)
    assert fp8.scale_blocks((200, 200), tuple(s64.shape)) == (50, 50)  # ambiguous: say blocks
    assert same_bits(
        fp8.dequantize(w64, s64, dtype=torch.float32, blocks=(64, 64)),
        reference_block_dequant(w64, s64, 64),
    )
    e8m0 = torch.tensor([[126, 128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ones = torch.ones(1, 64, dtype=torch.float8_e4m3fn)
    halves = fp8.dequantize(ones, e8m0, dtype=torch.float32)
    assert halves[0, :32].eq(0.5).all() and halves[0, 32:].eq(2.0).all()


def test_scale_blocks_layouts() -> None:
    assert fp8.scale_blocks((300, 200), (3, 2)) == (128, 128)
    assert fp8.scale_blocks((256, 512), (4, 2), prefer=None) == (64, 256)
    assert fp8.scale_blocks((48, 32), (48, 1)) == (1, 32)
    assert fp8.scale_blocks((48, 32), (48,)) == (1, 32)
    assert fp8.scale_blocks((48, 32), ()) == (48, 32)
    assert fp8.scale_blocks((10, 10), (6, 6)) is None
    assert fp8.scale_blocks((10, 10), (11, 1)) is None
    assert fp8.granularity((48, 32), (48, 1)) == "per-column"
    assert fp8.granularity((3, 130, 260), (1, 128, 128)) == "block 128x128"


def test_plan_rejects_unknown_mode(demo_dir: Path) -> None:
    with pytest.raises(ValueError, match="dequantize, unwrap, keep"):
        plan_fp8(inspector.open(demo_dir / "seed"), ["norm.weight"], mode="cast")


def test_plan_names_objects(demo_dir: Path) -> None:
    outputs, skipped = plan_fp8(inspector.open(demo_dir / "flat"), ["lr_scheduler.last_epoch"])
    assert outputs == [] and skipped == {"lr_scheduler.last_epoch": "not a tensor"}


def test_subclass_value_is_subclass_ref(saved_pt: Path) -> None:
    described, _ = via_archive(saved_pt)
    assert isinstance(described["f8_row"], SubclassRef)
    assert fp8.describe(torch.ones(2)) == fp8.Detection("plain")
