"""inspector.export: real consumers load what it writes; it is atomic and leaves sources alone."""

from __future__ import annotations

import errno
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import inspector
from inspector.errors import ExportError
from tests.conftest import run_python
from tests.fixtures.damage import tree_hash
from tests.fixtures.formats import same
from tests.hostile.pipeline import Probe, export_options, read_every_entry


def test_safetensors_single_file_is_the_flat_model(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    result = inspector.export(ck, tmp_path / "out", progress=False)
    assert result.files == [tmp_path / "out" / "model.safetensors"] and result.index is None
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(tensors) == sorted(
        k.removeprefix("model.") for k in ck.keys() if k.startswith("model.")
    )
    for key, value in tensors.items():
        assert same(value, ck.read(f"model.{key}")), key
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["source"] == str(ck.path) and meta["fp8"] == "dequantize"
    assert result.verification.ok and result.verification.checked == 21
    assert result.names["model.norm.weight"] == "norm.weight"
    assert result.skipped == {}


def test_keep_prefix_and_all_components(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    result = inspector.export(ck, tmp_path / "o", flatten=False, model_only=False, progress=False)
    names = set(load_file(tmp_path / "o" / "model.safetensors"))
    tensor_keys = {e.key for e in ck.entries() if e.kind == "tensor"}
    assert names == tensor_keys
    assert all(v.startswith("not a tensor") for v in result.skipped.values())
    assert set(result.skipped) == {e.key for e in ck.entries() if e.kind == "object"}


def test_sharded_like_huggingface(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    result = inspector.export(ck, tmp_path / "sh", max_shard_size="100KB", progress=False)
    count = len(result.files)
    assert count > 2
    assert [p.name for p in result.files] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    index = json.loads(result.index.read_text())
    assert index["metadata"]["total_size"] == sum(
        e.nbytes for e in ck.entries() if e.component == "model"
    )
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / "sh" / file, "pt") as f:
            assert same(f.get_tensor(name), ck.read(name))
    for path in result.files:
        assert (
            path.stat().st_size <= 100_000 + 70_000
        )  # a shard holds at most one tensor past the limit
    reopened = inspector.open(tmp_path / "sh")
    assert reopened.format == "safetensors-sharded" and sorted(reopened.keys()) == sorted(
        index["weight_map"]
    )


def test_huggingface_names_keep_their_model_prefix(hf_llama_dcp: dict, tmp_path: Path) -> None:
    ck = inspector.open(hf_llama_dcp["plain"])
    result = inspector.export(ck, tmp_path / "hf", progress=False)
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert "train_state.step" not in names and result.tensors == 21


@pytest.mark.parametrize("variant", ["plain", "fp8"])
def test_transformers_loads_the_export(hf_llama_dcp: dict, tmp_path: Path, variant: str) -> None:
    from transformers import LlamaForCausalLM

    from tests.fixtures import hf_llama

    out = tmp_path / "llama"
    hf_llama.config().save_pretrained(out)
    result = inspector.export(hf_llama_dcp[variant], out, progress=False)
    assert result.verification.ok
    if variant == "fp8":
        assert len(result.conversions) == 14 and all(
            "master weight" in c for c in result.conversions.values()
        )
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    reference = hf_llama.reference_model()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, reference(tokens).logits)


def test_pt_loads_with_weights_only_and_no_torchao(demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8.pt"
    code = (
        "import sys, inspector\n"
        "r = inspector.export(sys.argv[1], sys.argv[2], format='pt', progress=False)\n"
        "assert r.verification.ok, r.verification\n"
        "import torch\n"
        "sd = torch.load(sys.argv[2], weights_only=True)\n"
        "assert all(type(v) is torch.Tensor for v in sd.values())\n"
        "print(len(sd), 'torchao' in sys.modules and sys.modules['torchao'] is not None)\n"
    )
    done = run_python(code, str(demo_dir / "fp8"), str(out), block_torchao=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["21", "False"]
    loaded = torch.load(out, weights_only=True)
    reference = inspector.open(demo_dir / "fp8")
    for key, value in loaded.items():
        assert same(value, reference.read(key)), key


def test_seed_failure_fixed(demo_dir: Path, tmp_path: Path) -> None:
    """torch's dcp_to_torch_save fails on fp8/ without torchao; our export of it works there."""
    code = (
        "import sys\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    )
    failed = run_python(code, str(demo_dir / "fp8"), str(tmp_path / "torch.pt"), block_torchao=True)
    assert failed.returncode != 0 and "torchao" in failed.stderr
    code = (
        "import sys, inspector, torch\n"
        "inspector.export(sys.argv[1], sys.argv[2], format='pt', nested=True, model_only=False,"
        " flatten=False, progress=False)\n"
        "sd = torch.load(sys.argv[2], weights_only=True)\n"
        "print(sorted(sd)[:3])\n"
    )
    ours = run_python(code, str(demo_dir / "fp8"), str(tmp_path / "ours.pt"), block_torchao=True)
    assert ours.returncode == 0, ours.stderr
    assert "dataloader" in ours.stdout and "layers.0.attention.wk.weight" in ours.stdout


@pytest.mark.parametrize("name", ["flat", "prefixed", "seed"])
def test_nested_pt_equals_dcp_to_torch_save(demo_dir: Path, tmp_path: Path, name: str) -> None:
    dcp_to_torch_save(demo_dir / name, tmp_path / "torch.pt")
    result = inspector.export(
        demo_dir / name,
        tmp_path / "ours.pt",
        format="pt",
        nested=True,
        model_only=False,
        flatten=False,
        progress=False,
    )
    assert result.skipped == {} and result.verification.ok
    theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)

    def check(a, b, where=""):
        assert type(a) is type(b), where
        if isinstance(a, dict):
            assert list(a) == list(b) or set(a) == set(b), where
            for k in a:
                check(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, torch.Tensor):
            assert same(a, b), where
        else:
            assert a == b, where

    check(ours, theirs)


def test_dtype_cast_and_filters(demo_dir: Path, tmp_path: Path) -> None:
    result = inspector.export(
        demo_dir / "flat",
        tmp_path / "bf",
        dtype=torch.bfloat16,
        include=["layers.1.*", "norm.*"],
        exclude=["*.wk.weight"],
        progress=False,
    )
    tensors = load_file(tmp_path / "bf" / "model.safetensors")
    assert "layers.1.attention.wk.weight" not in tensors and "norm.weight" in tensors
    assert len(tensors) == 9 and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert result.conversions["norm.weight"] == "cast to bfloat16"


def test_rename_regex_exact_and_callable(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "seed")
    inspector.export(
        ck,
        tmp_path / "a",
        rename={r"^layers\.": "model.layers.", "norm.weight": "final.w"},
        progress=False,
    )
    names = set(load_file(tmp_path / "a" / "model.safetensors"))
    assert (
        "model.layers.0.attention.wq.weight" in names
        and "final.w" in names
        and "norm.weight" not in names
    )
    inspector.export(ck, tmp_path / "b", rename=str.upper, progress=False)
    assert "OUTPUT.WEIGHT" in load_file(tmp_path / "b" / "model.safetensors")
    with pytest.raises(ExportError, match="both be written as 'x'"):
        inspector.export(ck, tmp_path / "c", rename=lambda n: "x", progress=False)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_stored_keys_of_a_mapping_rename_exactly(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    report = inspector.check_keys(ck, [f"model.{k}" for k in ck.keys() if "optimizer" not in k])
    mapping = report.mapping()
    assert mapping["norm.weight"] == "model.norm.weight"
    out = tmp_path / "all.pt"
    inspector.export(ck, out, format="pt", model_only=False, rename=mapping, progress=False)
    names = set(torch.load(out, weights_only=True))
    assert {mapping[k] for k in mapping} <= names
    assert "optimizer.state.norm.weight.exp_avg" in names
    assert "optimizer.state.model.norm.weight.exp_avg" not in names


def test_aliased_tensors(tmp_path: Path) -> None:
    emb = torch.randn(10, 4)
    torch.save({"embed.weight": emb, "head.weight": emb, "view": emb[2:5]}, tmp_path / "tied.pt")
    inspector.export(tmp_path / "tied.pt", tmp_path / "out", progress=False)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert same(tensors["head.weight"], emb) and same(tensors["embed.weight"], emb)
    assert same(tensors["view"], emb[2:5].contiguous())


def test_unstorable_dtype_is_refused_clearly(tmp_path: Path) -> None:
    torch.save({"scale": torch.ones(4).to(torch.float8_e8m0fnu)}, tmp_path / "e8.pt")
    with pytest.raises(ExportError, match=r"'scale'.*cannot store float8_e8m0fnu.*\.pt"):
        inspector.export(tmp_path / "e8.pt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    inspector.export(tmp_path / "e8.pt", tmp_path / "e8_copy.pt", format="pt", progress=False)
    assert (
        torch.load(tmp_path / "e8_copy.pt", weights_only=True)["scale"].dtype
        == torch.float8_e8m0fnu
    )


# --- safety -------------------------------------------------------------------------------


def test_refuses_existing_output_and_source_folder(
    demo_dir: Path, demo_copy, tmp_path: Path
) -> None:
    inspector.export(demo_dir / "seed", tmp_path / "o", progress=False)
    before = (tmp_path / "o" / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="already exists; pass overwrite=True"):
        inspector.export(demo_dir / "seed", tmp_path / "o", dtype=torch.bfloat16, progress=False)
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == before
    inspector.export(
        demo_dir / "seed", tmp_path / "o", dtype=torch.bfloat16, overwrite=True, progress=False
    )
    assert (tmp_path / "o" / "model.safetensors").read_bytes() != before
    source = demo_copy("seed")
    with pytest.raises(ExportError, match="inside the source checkpoint"):
        inspector.export(source, source / "export", progress=False)
    assert sorted(p.name for p in source.iterdir()) == [".metadata", "__0_0.distcp"]


def test_source_is_byte_identical_afterwards(demo_copy, tmp_path: Path) -> None:
    source = demo_copy("fp8")
    before = tree_hash(source)
    inspector.export(source, tmp_path / "a", progress=False)
    inspector.export(
        source,
        tmp_path / "b.pt",
        format="pt",
        nested=True,
        model_only=False,
        flatten=False,
        progress=False,
    )
    assert tree_hash(source) == before


@pytest.mark.parametrize("format", ["safetensors", "pt"])
def test_interrupted_export_leaves_nothing(demo_dir: Path, tmp_path: Path, format: str) -> None:
    seen = []

    def interrupt(progress) -> None:
        seen.append(progress.key)
        if len(seen) == 5:
            raise KeyboardInterrupt

    out = tmp_path / ("sh" if format == "safetensors" else "sh.pt")
    with pytest.raises(KeyboardInterrupt):
        inspector.export(
            demo_dir / "flat",
            out,
            format=format,
            max_shard_size="100KB",
            on_progress=interrupt,
            progress=False,
        )
    assert len(seen) == 5
    leftovers = list(tmp_path.rglob("*"))
    assert [p for p in leftovers if p.is_file()] == []


@pytest.mark.parametrize(
    ("format", "limit"),
    [("safetensors", 150_000), ("pt", 1_000), ("pt", 150_000)],
)
def test_disk_full_midway_leaves_nothing(
    demo_dir: Path, tmp_path: Path, format: str, limit: int
) -> None:
    """A real write failure (file size limit, like ENOSPC) in the middle of an export: an
    OSError, no file left, and the process lives on (for .pt, torch's zip writer must not
    see the error: it would throw again from its destructor and abort the process)."""
    code = (
        "import resource, signal, sys, inspector\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))\n"
        "try:\n"
        "    inspector.export(sys.argv[1], sys.argv[2], format=sys.argv[4],\n"
        "                     max_shard_size='1MB', progress=False)\n"
        "except OSError as exc:\n"
        "    print('OSError', exc.errno)\n"
    )
    out = tmp_path / ("out.pt" if format == "pt" else "out")
    done = run_python(code, str(demo_dir / "flat"), str(out), str(limit), format)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OSError", str(errno.EFBIG)]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    "name", ["seed", "flat", "distcp_safetensors", "pt", "legacy", "safetensors", "hub"]
)
def test_every_entry_point_leaves_the_source_byte_identical(
    genuine, tmp_path: Path, name: str
) -> None:
    source = genuine.copy(name, tmp_path / "source")
    before = tree_hash(source)
    ck = inspector.open(source)
    ck.table()
    ck.scan(progress=False)
    ck.tree("prefixed")
    ck.consistency()
    assert not read_every_entry(Probe(), ck)
    inspector.check_keys(ck, source)
    assert inspector.diff(ck, source, progress=False).equal.all()
    for fmt in ("safetensors", "pt"):
        out = tmp_path / ("out.pt" if fmt == "pt" else "out")
        assert inspector.export(ck, out, **export_options(ck, fmt)).verification.ok
    assert tree_hash(source) == before


def test_concurrent_exports_do_not_interfere(demo_dir: Path, tmp_path: Path) -> None:
    """Six threads export one opened checkpoint to six folders at once, in both formats."""
    ck = inspector.open(demo_dir / "flat")
    jobs = [
        (fmt, tmp_path / str(i) / ("model.pt" if fmt == "pt" else ""))
        for i, fmt in enumerate(["safetensors", "pt"] * 3)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(
            pool.map(lambda job: inspector.export(ck, job[1], format=job[0], progress=False), jobs)
        )
    model = {k: ck.read(k) for k in ck.keys() if ck.entry(k).component == "model"}
    for (fmt, out), result in zip(jobs, results, strict=True):
        assert result.verification.ok and result.tensors == len(model)
        if fmt == "pt":
            written = torch.load(out, weights_only=True)
        else:
            written = load_file(out / "model.safetensors")
        assert written.keys() == model.keys()
        assert all(same(written[k], v) for k, v in model.items())
    safetensors = {(out / "model.safetensors").read_bytes() for fmt, out in jobs if fmt != "pt"}
    assert len(safetensors) == 1
    assert not [p for p in tmp_path.rglob("*") if ".inspector-" in p.name]


def test_unreadable_entries_fail_or_are_skipped(demo_copy, tmp_path: Path) -> None:
    source = demo_copy("flat")
    os.remove(source / "__1_0.distcp")
    with pytest.raises(ExportError, match=r"tok_embeddings\.weight.*on_error='skip'"):
        inspector.export(source, tmp_path / "a", progress=False)
    result = inspector.export(source, tmp_path / "b", on_error="skip", progress=False)
    assert result.tensors == 0 and len(result.skipped) == 21  # every model tensor spans both ranks
    assert all("__1_0.distcp is missing" in why for why in result.skipped.values())


def test_corrupt_chunk_found_while_writing_is_skipped(demo_copy, tmp_path: Path) -> None:
    source = demo_copy("seed")
    ck = inspector.open(source)
    chunk = ck.entry("layers.1.ffn_norm.weight").chunks[0]
    with open(source / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\0" * 16)
    result = inspector.export(source, tmp_path / "s", on_error="skip", progress=False)
    assert list(result.skipped) == ["layers.1.ffn_norm.weight"]
    assert result.tensors == 20 and result.verification.ok
    assert "layers.1.ffn_norm.weight" not in load_file(tmp_path / "s" / "model.safetensors")
    with pytest.raises(ExportError, match=r"layers\.1\.ffn_norm\.weight.*cannot be read"):
        inspector.export(source, tmp_path / "f", progress=False)
    assert not any(p.is_file() for p in tmp_path.joinpath("f").rglob("*"))


def test_damage_found_only_while_writing_is_skipped(demo_copy, tmp_path: Path) -> None:
    """The tensor record's header is broken: the scan (pickle only) passes, the read fails."""
    from inspector.formats.torch_archive import TorchArchive
    from inspector.storage import LocalStorage

    source = demo_copy("seed")
    entry = inspector.open(source).entry("layers.0.attention.wv.weight")
    chunk = entry.chunks[0]
    with LocalStorage(source).window(chunk.file, chunk.byte_offset, chunk.byte_length) as item:
        archive = TorchArchive(item, chunk.file, chunk.byte_length, entry.key)
        header = archive._infos[archive.prefix + "data/0"].header_offset
    with open(source / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset + header)
        f.write(b"XXXX")
    for fmt, out in (("safetensors", tmp_path / "s"), ("pt", tmp_path / "s.pt")):
        result = inspector.export(source, out, format=fmt, on_error="skip", progress=False)
        assert list(result.skipped) == [entry.key], fmt
        assert "bad local header" in result.skipped[entry.key]
        assert result.tensors == 20 and result.verification.ok
    with pytest.raises(inspector.CorruptCheckpointError, match=r"wv\.weight.*bad local header"):
        inspector.export(source, tmp_path / "f", progress=False)
    assert not any(p.is_file() for p in tmp_path.joinpath("f").rglob("*"))


def test_cli_export(demo_dir: Path, tmp_path: Path) -> None:
    from tests.ui.test_cli import cli

    done = cli(
        "export",
        str(demo_dir / "prefixed"),
        str(tmp_path / "x"),
        "--dtype",
        "bfloat16",
        "--exclude",
        "*norm*",
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 16 tensors" in done.stdout and "verified 16 tensors bit-exact" in done.stdout
    again = cli("export", str(demo_dir / "prefixed"), str(tmp_path / "x"))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_pt_round_trips_every_dtype_as_a_valid_zip(tmp_path: Path) -> None:
    import zipfile

    from tests.fixtures.formats import dtype_zoo

    zoo = dtype_zoo()
    torch.save(zoo, tmp_path / "zoo.pt")
    result = inspector.export(
        tmp_path / "zoo.pt", tmp_path / "out.pt", format="pt", fp8="keep", progress=False
    )
    assert result.verification.ok and result.conversions == {}
    loaded = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert sorted(loaded) == sorted(zoo)
    for key, value in zoo.items():
        assert same(loaded[key], value), key
    assert zipfile.ZipFile(tmp_path / "out.pt").testzip() is None  # every CRC-32 is right
    torch.save({k: v for k, v in zoo.items() if "e8m0" not in k}, tmp_path / "st.pt")
    inspector.export(tmp_path / "st.pt", tmp_path / "st", fp8="keep", progress=False)
    for key, value in load_file(tmp_path / "st" / "model.safetensors").items():
        assert same(value, zoo[key]), key


def test_keep_mode_parts_follow_a_renamed_tensor(tmp_path: Path) -> None:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    weight = torch.randn(16, 32)
    f8 = hp_tensor_to_float8_dynamic(weight, torch.float8_e4m3fn, LinearMMConfig())
    torch.save({"w": f8, "b": torch.ones(4)}, tmp_path / "f8.pt")
    result = inspector.export(
        tmp_path / "f8.pt",
        tmp_path / "out",
        fp8="keep",
        rename={"w": "layer.w", "b": "layer.b"},
        progress=False,
    )
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == ["layer.b", "layer.w", "layer.w_scale"]
    assert same(written["layer.w"], f8._data) and same(written["layer.w_scale"], f8._scale)
    assert result.verification.ok


@pytest.mark.parametrize(
    ("target", "options"),
    [
        ("deep/folder", {"max_shard_size": "100KB"}),
        ("deep/folder/one.safetensors", {"max_shard_size": "20GB"}),
        ("deep/folder/model.pt", {"format": "pt"}),
        ("deep/workers", {"max_shard_size": "100KB", "workers": 2}),
    ],
)
def test_a_failed_export_leaves_nothing(tmp_path: Path, target: str, options: dict) -> None:
    """A stride-0 view too large to write dense fails the export after other tensors were
    written: no shard, index, temporary file or folder is left."""
    source = tmp_path / "source.pt"
    torch.save({"a": torch.arange(40000.0), "zeros": torch.zeros(1).expand(1 << 31),
                "w": torch.arange(12.0)}, source)
    with pytest.raises(ExportError, match=r"zeros.*stride-0 view"):
        inspector.export(source, tmp_path / target, progress=False, model_only=False, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.pt"]


def test_the_target_suffix_decides_the_format_unless_it_contradicts_it(
    demo_dir: Path, tmp_path: Path
) -> None:
    from inspector.errors import UsageError

    ck = inspector.open(demo_dir / "seed")
    for name in ("weights.pt", "weights.pth", "weights.bin"):
        result = inspector.export(ck, tmp_path / name)
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert result.format == "pt" and sorted(loaded) == sorted(ck.keys())
    assert inspector.export(ck, tmp_path / "folder").format == "safetensors"
    assert inspector.export(ck, tmp_path / "one.safetensors").format == "safetensors"
    for target, given in (("w.safetensors", "pt"), ("w.pt", "safetensors"), ("w.pt", "hf")):
        with pytest.raises(UsageError, match=f"is a .{target.split('.')[1]} file"):
            inspector.export(ck, tmp_path / target, format=given)
        assert not (tmp_path / target).exists()
