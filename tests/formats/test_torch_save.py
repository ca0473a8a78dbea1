"""torch.save files: keys flattened like DCP, values bit-exact, nothing ever executed."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

import inspector
from inspector.dtypes import name_of
from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.formats.safe_pickle import Opaque
from tests.conftest import run_python
from tests.fixtures.damage import bytes_read, copy, drop_zip_record, truncate
from tests.fixtures.formats import FLOAT8, same

WRAPPER = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"


def check_values(ck, state: dict) -> None:
    """Every key holds what the producer wrote: tensors bit-exact, objects equal."""
    assert set(ck.keys()) == set(state)
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            entry = ck.entry(key)
            assert (entry.kind, entry.dtype, entry.shape) == (
                "tensor",
                name_of(want.dtype),
                want.shape,
            )
            assert same(ck.read(key), want), key
        elif not hasattr(want, "__dataclass_fields__"):
            assert ck.entry(key).kind == "object"
            assert ck.read_object(key) == want, key


def test_nested_state_flattened_like_dcp(torch_save_written: dict) -> None:
    written = torch_save_written["nested"]
    ck = inspector.open(written.path)
    assert ck.format == "torch-save" and ck.source_files == ("nested.pt",)
    assert ck.keys() == list(written.state)
    check_values(ck, written.state)
    for key, path in written.nested_paths.items():
        assert ck.entry(key).nested_path == path, key
    assert ck.entry("optimizer.param_groups.0.lr").nested_path == (
        "optimizer",
        "param_groups",
        0,
        "lr",
    )


def test_nested_state_components_and_layout(torch_save_written: dict) -> None:
    ck = inspector.open(torch_save_written["nested"].path)
    assert ck.layout == "prefixed"
    assert ck.components() == {
        "model": 17,
        "optimizer": 5,
        "lr_scheduler": 2,
        "train_state": 2,
        "other": 1,
    }
    assert {ck.entry(f"model.{str(dt).removeprefix('torch.')}").dtype for dt in FLOAT8} == set(
        map(name_of, FLOAT8)
    )


def test_unknown_class_is_an_inert_labelled_placeholder(torch_save_written: dict) -> None:
    ck = inspector.open(torch_save_written["nested"].path)
    config = ck.read_object("train_state.config")
    assert isinstance(config, Opaque)
    assert config.global_name == "tests.fixtures.formats.RunConfig"
    assert config.state == {"name": "tiny", "layers": 2}
    assert ck.source.chunk_globals(ck.entry("train_state.config"), 0) == [
        "tests.fixtures.formats.RunConfig"
    ]


def test_model_state_dict(torch_save_written: dict) -> None:
    written = torch_save_written["state_dict"]
    ck = inspector.open(written.path)
    assert ck.keys() == list(written.state)
    check_values(ck, written.state)
    assert ck.layout == "model-only" and ck.components() == {"model": 21}


def test_legacy_pre_1_6_format(torch_save_written: dict) -> None:
    written = torch_save_written["legacy"]
    ck = inspector.open(written.path)
    assert ck.format == "torch-save"
    assert "pre-1.6" in ck.describe_layout()
    check_values(ck, written.state)


def test_legacy_truncated(torch_save_written: dict, tmp_path: Path) -> None:
    path = copy(torch_save_written["legacy"].path, tmp_path)
    truncate(path, path.stat().st_size - 10)
    ck = inspector.open(path)
    broken = [e.key for e in ck.entries() if e.error]
    errors = [ck.facts(k).error for k in broken]
    assert broken and "end of the file" in errors[0]
    assert all("after storage" in e and "cannot be read" in e for e in errors[1:])
    with pytest.raises(CorruptCheckpointError, match=rf"legacy\.pth.*{broken[0]!r}"):
        ck.read(broken[0])
    good = next(k for k in ck.keys() if not ck.facts(k).error and ck.entry(k).numel)
    assert same(ck.read(good), torch_save_written["legacy"].state[good])


def test_views_and_shared_storage(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {"base": base, "rows": base[1:3], "cols": base[:, 2], "t": base.t(), "again": base}
    torch.save(state, tmp_path / "views.pt")
    ck = inspector.open(tmp_path / "views.pt")
    for key, want in state.items():
        assert torch.equal(ck.read(key), want), key
    assert ck.entry("rows").chunks[0].byte_offset == ck.entry("base").chunks[0].byte_offset + 48


def test_lone_tensor_listed_under_file_name(tmp_path: Path) -> None:
    torch.save(torch.ones(3, dtype=torch.bfloat16), tmp_path / "embedding.pt")
    ck = inspector.open(tmp_path / "embedding.pt")
    assert ck.keys() == ["embedding"]
    assert same(ck.read("embedding"), torch.ones(3, dtype=torch.bfloat16))


def test_meta_tensor_is_marked(tmp_path: Path) -> None:
    torch.save({"w": torch.empty(3, device="meta"), "b": torch.ones(2)}, tmp_path / "m.pt")
    ck = inspector.open(tmp_path / "m.pt")
    assert "meta tensor" in ck.facts("w").error
    assert torch.equal(ck.read("b"), torch.ones(2))


def test_keys_that_flatten_alike_are_marked(tmp_path: Path) -> None:
    torch.save({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}, tmp_path / "clash.pt")
    ck = inspector.open(tmp_path / "clash.pt")
    assert "both flatten to this key" in ck.facts("a.b").error


def test_open_reads_the_pickle_only(tmp_path: Path) -> None:
    big = torch.arange(8 << 20, dtype=torch.float32)
    torch.save({"big": big, "small": torch.arange(4)}, tmp_path / "big.pt")
    inspector.open(tmp_path / "big.pt")
    before = bytes_read()
    ck = inspector.open(tmp_path / "big.pt")
    opened = bytes_read()
    assert torch.equal(ck.read("small"), torch.arange(4))
    assert opened - before < 64 << 10
    assert bytes_read() - opened < 64 << 10


# --- dcp_to_torch_save: same keys and values as the DCP folder it came from -----------------


@pytest.mark.parametrize("name", ["flat", "prefixed", "seed", "fp8"])
def test_dcp_to_torch_save_matches_dcp(demo_dir: Path, dcp_torch_save: dict, name: str) -> None:
    dcp_ck = inspector.open(demo_dir / name)
    pt_ck = inspector.open(dcp_torch_save[name])
    assert sorted(pt_ck.keys()) == sorted(dcp_ck.keys())
    assert (pt_ck.layout, pt_ck.components()) == (dcp_ck.layout, dcp_ck.components())
    for key in dcp_ck.keys():
        want, got = dcp_ck.entry(key), pt_ck.entry(key)
        assert got.nested_path == want.nested_path, key
        assert (got.kind, got.dtype, got.shape) == (want.kind, want.dtype, want.shape), key
        if want.kind == "tensor":
            assert same(pt_ck.read(key), dcp_ck.read(key)), key
        else:
            assert pt_ck.read_object(key) == dcp_ck.read_object(key), key


# --- tensor subclasses and hostile pickles --------------------------------------------------


@pytest.fixture(scope="module")
def fp8_written(tmp_path_factory: pytest.TempPathFactory):
    from tests.fixtures.formats import write_fp8_wrapper

    return write_fp8_wrapper(tmp_path_factory.mktemp("fp8_pt"))


def test_fp8_wrapper_entries(fp8_written, demo_dir: Path) -> None:
    ck = inspector.open(fp8_written.path)
    entry = ck.entry("layers.0.attention.wq.weight")
    assert WRAPPER in ck.source.chunk_globals(entry, 0)
    assert ck.source.chunk_globals(ck.entry("output.weight"), 0) == []
    ck.scan(progress=False)
    dcp = inspector.open(demo_dir / "fp8")
    dcp.scan(progress=False)
    for key in ("layers.0.attention.wq.weight", "output.weight"):
        assert (ck.facts(key).subclass, ck.facts(key).fp8) == (
            dcp.facts(key).subclass,
            dcp.facts(key).fp8,
        )
    assert ck.facts(entry.key).subclass == "WeightWithDynamicFloat8CastTensor"
    for key, want in fp8_written.state.items():
        plain = want._tensor if hasattr(want, "_tensor") else want
        assert same(ck.read(key), plain.detach()), key


def test_fp8_wrapper_reads_without_torchao(fp8_written) -> None:
    code = (
        "import json, sys, inspector\n"
        "ck = inspector.open(sys.argv[1])\n"
        "ck.scan(progress=False)\n"
        "t = ck.read('layers.1.feed_forward.w1.weight')\n"
        "print(json.dumps({'type': type(t).__name__, 'sum': float(t.double().sum()),"
        " 'subclass': ck.facts('layers.1.feed_forward.w1.weight').subclass,"
        " 'torchao': sys.modules.get('torchao') is not None}))\n"
    )
    result = run_python(code, str(fp8_written.path), block_torchao=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    want = fp8_written.state["layers.1.feed_forward.w1.weight"]._tensor.detach()
    assert out == {
        "type": "Tensor",
        "sum": float(want.double().sum()),
        "subclass": "WeightWithDynamicFloat8CastTensor",
        "torchao": False,
    }


def test_torch_itself_needs_torchao_for_this_file(fp8_written) -> None:
    code = "import sys, torch\ntorch.load(sys.argv[1], weights_only=True)\n"
    result = run_python(code, str(fp8_written.path), block_torchao=True)
    assert result.returncode != 0


# --- damaged files ----------------------------------------------------------------------------


def test_zip_missing_record(torch_save_written: dict, tmp_path: Path) -> None:
    path = copy(torch_save_written["state_dict"].path, tmp_path)
    dropped = drop_zip_record(path, "/data/3")
    ck = inspector.open(path)
    broken = [e.key for e in ck.entries() if e.error]
    assert len(broken) == 1 and dropped in ck.facts(broken[0]).error
    with pytest.raises(CorruptCheckpointError, match=rf"pytorch_model\.bin.*{broken[0]!r}.*data/3"):
        ck.read(broken[0])
    key = next(k for k in ck.keys() if k not in broken)
    assert same(ck.read(key), torch_save_written["state_dict"].state[key])


def test_zip_without_data_pkl(torch_save_written: dict, tmp_path: Path) -> None:
    path = copy(torch_save_written["state_dict"].path, tmp_path)
    drop_zip_record(path, "data.pkl")
    with pytest.raises(CorruptCheckpointError, match=r"pytorch_model\.bin.*no data\.pkl"):
        inspector.open(path)


def test_truncated_zip(torch_save_written: dict, tmp_path: Path) -> None:
    path = copy(torch_save_written["nested"].path, tmp_path)
    truncate(path, path.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match=r"nested\.pt.*not a readable torch\.save"):
        inspector.open(path)


def test_tar_format_refused(tmp_path: Path) -> None:
    (tmp_path / "pickle").write_bytes(b"\x80\x02N.")
    path = tmp_path / "ancient.pt"
    with tarfile.open(path, "w") as tar:
        tar.add(tmp_path / "pickle", arcname="pickle")
    with pytest.raises(UnsupportedError, match=r"ancient\.pt.*tar"):
        inspector.open(path)


def test_pickle_that_is_not_torch(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "plain.pkl.bin"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(CorruptCheckpointError, match=r"plain\.pkl\.bin.*not one torch\.save wrote"):
        inspector.open(path)
