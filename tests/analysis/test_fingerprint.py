"""``inspector.fingerprint``: the same weights give the same digest whatever the format,
sharding, rank count, key prefix or file layout; another dtype, shape or value does not."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from safetensors.torch import save_file

import inspector
from inspector.analysis.fingerprint import ALGORITHM, model_digest, tensor_digest
from inspector.demo.gloo import run_ranks

WQ = "layers.0.attention.wq.weight"


def digest_of(tensor: torch.Tensor) -> str:
    """The definition, independently: BLAKE3 of "dtype:shape\\n" and the row-major bytes."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    header = f"{dtype}:{','.join(map(str, tensor.shape))}\n".encode()
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return blake3.blake3(header + data).hexdigest(16)


@pytest.fixture(scope="module")
def exports(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fingerprint_exports")
    flat = demo_dir / "flat"
    inspector.export(flat, out / "st", progress=False)
    inspector.export(flat, out / "sharded", max_shard_size="50KB", progress=False)
    inspector.export(flat, out / "flat.pt", format="pt", progress=False)
    inspector.export(
        demo_dir / "prefixed", out / "nested.pt", format="pt", nested=True, progress=False
    )
    return {
        "safetensors": out / "st",
        "sharded": out / "sharded",
        "pt": out / "flat.pt",
        "pt-nested": out / "nested.pt",
    }


def test_same_weights_same_fingerprint(
    demo_dir: Path, exports: dict[str, Path], resave: Callable[..., Path]
) -> None:
    reference = inspector.fingerprint(demo_dir / "flat")
    assert len(reference.tensors) == 21 and reference.algorithm == ALGORITHM
    assert (
        len(
            json.loads((exports["sharded"] / "model.safetensors.index.json").read_text())[
                "weight_map"
            ]
        )
        == 21
    )
    others = {
        "prefixed (model. twin)": demo_dir / "prefixed",
        "1-rank re-save": resave("one-rank"),
        **exports,
    }
    for name, path in others.items():
        found = inspector.fingerprint(path)
        assert found.tensors == reference.tensors, name
        assert found.digest == reference.digest, name
    assert inspector.open(others["1-rank re-save"]).ranks == 1
    assert inspector.open(demo_dir / "flat").ranks == 2


def test_tensor_digest_is_blake3_of_dtype_shape_and_values(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    found = inspector.fingerprint(ck)
    for name, digest in found.tensors.items():
        assert digest == digest_of(ck.read(name)), name
    whole = blake3.blake3()
    for name in sorted(found.tensors):
        whole.update(name.encode() + b"\0" + bytes.fromhex(found.tensors[name]))
    assert found.digest == whole.hexdigest(16)


@pytest.mark.parametrize(
    ("label", "change"),
    [
        ("dtype", lambda t: t.to(torch.bfloat16)),
        ("shape", lambda t: t.reshape(32, 128)),
        ("value", lambda t: t.index_put((torch.tensor([5]), torch.tensor([7])), t[5, 7] + 1e-6)),
    ],
)
def test_another_dtype_shape_or_value_changes_it(
    demo_dir: Path, resave: Callable[..., Path], label: str, change: Callable
) -> None:
    def edit(state: dict[str, Any]) -> None:
        state[WQ] = change(state[WQ])

    reference = inspector.fingerprint(demo_dir / "flat")
    found = inspector.fingerprint(resave(label, edit))
    assert found.digest != reference.digest
    assert {n for n in found.tensors if found.tensors[n] != reference.tensors[n]} == {WQ}


def test_fp8_and_plain_runs_differ(demo_dir: Path) -> None:
    plain, fp8 = (inspector.fingerprint(demo_dir / n) for n in ("flat", "fp8"))
    assert plain.digest != fp8.digest
    assert set(plain.tensors) == set(fp8.tensors)
    assert plain.tensors["norm.weight"] != fp8.tensors["norm.weight"]


def test_fp8_wrappers_hash_as_their_master_weights(demo_dir: Path, tmp_path: Path) -> None:
    """Subclass chunks are assembled band by band; the unwrapped export holds plain bytes."""
    ck = inspector.open(demo_dir / "fp8")
    ck.scan(progress=False)
    assert ck.facts(WQ).subclass and ck.byte_ranges(WQ) is None
    inspector.export(ck, tmp_path / "out", fp8="unwrap", progress=False)
    found, exported = inspector.fingerprint(ck), inspector.fingerprint(tmp_path / "out")
    assert found.tensors == exported.tensors and found.digest == exported.digest
    assert found.tensors[WQ] == digest_of(ck.read(WQ))


def _save_split(rank: int, world_size: int, path: str) -> None:
    """Tensors split along dim 1, dims 0 and 1 (a 2-D mesh), and dim 0 unevenly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = split_tensors()
    state = {
        "columns": distribute_tensor(full["columns"], mesh, [Shard(1)]),
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "plain": full["plain"],
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def split_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {
        "columns": torch.randn(5, 6),
        "rows": torch.randn(7, 3).to(torch.bfloat16),
        "plain": torch.arange(4, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def split_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("split") / "ckpt"
    run_ranks(_save_split, str(path))
    return path


def test_chunks_split_along_other_dims(split_dcp: Path, tmp_path: Path) -> None:
    ck = inspector.open(split_dcp)
    assert [c.offsets for c in ck.entry("columns").chunks] == [(0, 0), (0, 3)]
    assert ck.byte_ranges("columns") is None  # not row-major pieces: assembled in bands
    full = split_tensors()
    save_file(full, tmp_path / "full.safetensors")
    found = inspector.fingerprint(ck, keys="*")
    assert found.tensors == inspector.fingerprint(tmp_path / "full.safetensors").tensors
    assert found.tensors == {name: digest_of(t) for name, t in full.items()}


def test_keys_choose_tensors_of_any_component(demo_dir: Path, resave: Callable[..., Path]) -> None:
    moments = "optimizer.state.*.exp_avg*"
    flat = inspector.fingerprint(demo_dir / "flat", keys=moments)
    assert len(flat.tensors) == 42 and all(n.startswith("optimizer.") for n in flat.tensors)
    assert inspector.fingerprint(demo_dir / "prefixed", keys=moments).digest == flat.digest
    assert inspector.fingerprint(resave("again"), keys=moments).digest == flat.digest
    norms = inspector.fingerprint(demo_dir / "prefixed", keys=["*norm.weight", "model.output.*"])
    assert set(norms.tensors) == {
        "norm.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "layers.1.attention_norm.weight",
        "layers.1.ffn_norm.weight",
        "output.weight",
    }


def test_names_stored_twice_and_the_json_shape(tmp_path: Path) -> None:
    w = torch.arange(6.0).reshape(2, 3)
    save_file({"_orig_mod.w": w, "w": w + 1, "b": torch.zeros(2)}, tmp_path / "twice.safetensors")
    found = inspector.fingerprint(tmp_path / "twice.safetensors")
    assert found.duplicates == ("w",)
    assert found.tensors == {"b": digest_of(torch.zeros(2)), "w": digest_of(w)}
    payload = json.loads(json.dumps(found.as_dict()))
    assert payload["tensors"]["w"] == {
        "key": "_orig_mod.w",
        "dtype": "float32",
        "shape": [2, 3],
        "digest": digest_of(w),
    }
    assert set(payload) == {"checkpoint", "algorithm", "digest", "duplicates", "tensors"}


def test_diff_skips_equal_fingerprints(demo_dir: Path, resave: Callable[..., Path]) -> None:
    def nudge(state: dict[str, Any]) -> None:
        state[WQ][1, 2] += 0.5

    changed = resave("nudged", nudge)
    a = inspector.open(demo_dir / "prefixed")
    fast = inspector.diff(a, changed, fingerprints=True, progress=False)
    slow = inspector.diff(a, changed, progress=False)
    columns = ["key", "key_b", "status", "equal", "n_diff", "max_abs_diff"]
    assert fast[columns].equals(slow[columns])
    assert set(fast[~fast.equal].key) == {f"model.{WQ}"}
    row = fast[fast.key == f"model.{WQ}"].iloc[0]
    assert (row.n_diff, row.max_abs_diff) == (1, 0.5)
    same = fast[(fast.kind == "tensor") & fast.equal]
    assert len(same) == 20 + 63 + 2  # weights, optimizer tensors, train_state
    assert (same.hash_a == same.hash_b).all()
    assert row.hash_b == tensor_digest(inspector.open(changed), WQ)


def test_model_digest_from_a_diffs_tensor_digests(
    demo_dir: Path, resave: Callable[..., Path]
) -> None:
    def nudge(state: dict[str, Any]) -> None:
        state[WQ][1, 2] += 0.5

    changed = inspector.open(resave("nudged-twice", nudge))
    a = inspector.open(demo_dir / "prefixed")
    table = inspector.diff(a, changed, fingerprints=True, progress=False)
    tensors = table[table.kind == "tensor"]
    digests_a = dict(zip(tensors.key, tensors.hash_a, strict=True))
    digests_b = dict(zip(tensors.key_b, tensors.hash_b, strict=True))
    read = a.io.bytes
    assert model_digest(a, digests_a) == inspector.fingerprint(demo_dir / "prefixed").digest
    assert a.io.bytes == read  # every model tensor's digest was given: nothing read
    assert model_digest(changed, digests_b) == inspector.fingerprint(changed).digest
    assert model_digest(a, {}) == inspector.fingerprint(a).digest != model_digest(changed, {})
