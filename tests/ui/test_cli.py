"""``ckpt-inspect`` as a user runs it: a real process, real output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import inspector
from inspector.ui.cli import main

ENTRY_FIELDS = {
    "key",
    "component",
    "kind",
    "dtype",
    "shape",
    "numel",
    "nbytes",
    "chunks",
    "files",
    "subclass",
    "fp8",
    "error",
}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("ckpt-inspect")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_ls_table(demo_dir: Path) -> None:
    result = cli("ls", str(demo_dir / "prefixed"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "format=dcp" in lines[0] and "layout=prefixed" in lines[0]
    assert lines[1].split() == ["key", "dtype", "shape", "chunks", "size"]
    row = next(line for line in lines if line.startswith("model.layers.0.feed_forward.w1.weight "))
    assert row.split() == [
        "model.layers.0.feed_forward.w1.weight",
        "float32",
        "128x64",
        "2",
        "32.8",
        "KB",
    ]
    assert len(lines) == 2 + len(inspector.open(demo_dir / "prefixed").keys())


def test_ls_into_a_closed_pipe_ends_quietly(demo_dir: Path) -> None:
    exe = Path(sys.executable).with_name("ckpt-inspect")
    result = subprocess.run(
        f"'{exe}' ls '{demo_dir / 'prefixed'}' --json | head -c 100",  # > a pipe's 64 KiB
        shell=True, capture_output=True, text=True, timeout=120,
    )
    assert len(result.stdout) == 100 and result.stdout.startswith("{")
    assert result.stderr == ""


def test_main_leaves_signal_handlers_alone(demo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Run in-process (a notebook, a test), the CLI must not make SIGPIPE kill its caller."""
    before = signal.getsignal(signal.SIGPIPE)
    assert main(["ls", str(demo_dir / "prefixed")]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN
    assert "layout=prefixed" in capsys.readouterr().out


def test_ls_json(demo_dir: Path) -> None:
    result = cli("ls", str(demo_dir / "flat"), "--json")
    payload = json.loads(result.stdout)
    assert payload["format"] == "dcp" and payload["layout"] == "flat"
    entries = {e["key"]: e for e in payload["entries"]}
    assert set(entries["norm.weight"]) == ENTRY_FIELDS
    assert entries["norm.weight"] | {"files": None} == {
        "key": "norm.weight",
        "component": "model",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [64],
        "numel": 64,
        "nbytes": 256,
        "chunks": 2,
        "files": None,
        "subclass": None,
        "fp8": None,
        "error": None,
    }
    assert entries["lr_scheduler.last_epoch"]["kind"] == "object"


def test_show_tensor_and_object(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "seed")
    first = ck.read("layers.0.attention_norm.weight")[:8].tolist()
    result = cli("show", str(demo_dir / "seed"), "layers.0.attention_norm.weight")
    assert result.returncode == 0, result.stderr
    assert "dtype    float32" in result.stdout and "shape    [64]" in result.stdout
    assert f"values   {first} ..." in result.stdout
    result = cli("show", str(demo_dir / "flat"), "lr_scheduler.base_lrs")
    assert result.stdout.splitlines()[-1] == "[0.001]"


def test_errors_are_one_line(tmp_path: Path) -> None:
    result = cli("ls", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and str(tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_diff_exit_codes_and_json(demo_dir: Path) -> None:
    same = cli("diff", str(demo_dir / "flat"), str(demo_dir / "flat"), "--key-map", "none")
    assert same.returncode == 0, same.stderr
    assert same.stdout.splitlines()[0] == "347 keys: 347 same"
    different = cli(
        "diff", str(demo_dir / "seed"), str(demo_dir / "flat"), "--key-map", "none", "--json"
    )
    assert different.returncode == 1
    payload = json.loads(different.stdout)
    assert payload["equal"] is False
    assert payload["summary"] == {
        "same": 0,
        "dtype": 0,
        "values": 21,
        "shape": 0,
        "only_a": 0,
        "only_b": 326,
    }
    row = next(r for r in payload["rows"] if r["key"] == "norm.weight")
    assert row["status"] == "values" and row["n_diff"] > 0
    keys_only = cli(
        "diff", str(demo_dir / "seed"), str(demo_dir / "flat"), "--key-map", "none", "--keys-only"
    )
    assert keys_only.returncode == 1 and keys_only.stdout.startswith(
        "347 keys: 21 same, 326 only_b"
    )


def test_ls_shows_fp8_subclasses(demo_dir: Path) -> None:
    result = cli("ls", str(demo_dir / "fp8"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["key", "dtype", "shape", "chunks", "size", "subclass", "fp8"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["layers.0.feed_forward.w2.weight"] == [
        "float32",
        "64x128",
        "2",
        "32.8",
        "KB",
        "WeightWithDynamicFloat8CastTensor",
        "wrapper",
        "->",
        "float8_e4m3fn",
    ]
    assert rows["output.weight"] == ["float32", "256x64", "2", "65.5", "KB"]
    assert sum("WeightWithDynamicFloat8CastTensor" in line for line in lines) == 14
    payload = json.loads(cli("ls", str(demo_dir / "fp8"), "--json").stdout)
    entries = {e["key"]: e for e in payload["entries"]}
    assert entries["layers.1.attention.wq.weight"]["fp8"] == "wrapper -> float8_e4m3fn"
    assert entries["norm.weight"]["subclass"] is None


def test_ls_no_scan_reads_metadata_only(demo_dir: Path) -> None:
    result = cli("ls", str(demo_dir / "fp8"), "--no-scan")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split() == ["key", "dtype", "shape", "chunks", "size"]
    assert "WeightWithDynamicFloat8CastTensor" not in result.stdout


def test_show_names_the_subclass(demo_dir: Path) -> None:
    result = cli("show", str(demo_dir / "fp8"), "layers.0.attention.wq.weight")
    assert result.returncode == 0, result.stderr
    assert "subclass WeightWithDynamicFloat8CastTensor" in result.stdout
    assert "fp8      wrapper -> float8_e4m3fn" in result.stdout


LS_FIELDS = {"path", "format", "producer", "layout", "source_files", "notes", "metadata", "entries"}


@pytest.fixture
def every_format(
    demo_dir: Path,
    torch_save_written: dict,
    safetensors_written: dict,
    dcp_single_written: dict,
    dcp_distributed_written: dict,
) -> dict[str, tuple[Path, str]]:
    """One checkpoint per format: ``{label: (path, expected format)}``."""
    return {
        "dcp": (demo_dir / "flat", "dcp"),
        "torch-save": (torch_save_written["nested"].path, "torch-save"),
        "torch-save-legacy": (torch_save_written["legacy"].path, "torch-save"),
        "safetensors": (safetensors_written["single"].path, "safetensors"),
        "hub-sharded": (safetensors_written["sharded"].path, "safetensors-sharded"),
        "hub-bin": (safetensors_written["bin-sharded"].path, "torch-save"),
        "dcp-hf": (dcp_single_written["hf"].path, "dcp-safetensors"),
        "dcp-hf-2proc": (dcp_distributed_written["hf-distributed"].path, "dcp-safetensors"),
        "distcp-safetensors": (
            dcp_distributed_written["distcp-safetensors"].path,
            "dcp-safetensors",
        ),
        "hf-export": (dcp_distributed_written["hf-export"].path, "safetensors-sharded"),
    }


def test_ls_every_format(every_format: dict, capsys: pytest.CaptureFixture) -> None:
    """In-process (the JSON test below runs a real process per format)."""
    for label, (path, fmt) in every_format.items():
        assert main(["ls", str(path)]) == 0, label
        lines = capsys.readouterr().out.splitlines()
        assert f"format={fmt}" in lines[0], label
        assert len(lines) == 2 + len(inspector.open(path).keys()), label


def test_ls_json_same_shape_for_every_format(every_format: dict) -> None:
    for label, (path, fmt) in every_format.items():
        payload = json.loads(cli("ls", str(path), "--json").stdout)
        assert set(payload) == LS_FIELDS, label
        assert payload["format"] == fmt, label
        ck = inspector.open(path)
        assert payload["source_files"] == list(ck.source_files) and payload["source_files"]
        assert payload["notes"] and all(isinstance(n, str) for n in payload["notes"])
        assert all(isinstance(v, str) for v in payload["metadata"].values())
        assert [e["key"] for e in payload["entries"]] == ck.keys(), label
        assert all(set(e) == ENTRY_FIELDS for e in payload["entries"]), label


def test_ls_json_safetensors_entry(safetensors_written: dict) -> None:
    payload = json.loads(cli("ls", str(safetensors_written["single"].path), "--json").stdout)
    entry = next(e for e in payload["entries"] if e["key"] == "zoo.float8_e4m3fn")
    assert entry.pop("fp8")  # described by inspector.fp8 (plain float8, no scale sibling)
    assert entry == {
        "key": "zoo.float8_e4m3fn",
        "component": "model",
        "kind": "tensor",
        "dtype": "float8_e4m3fn",
        "shape": [8, 6],
        "numel": 48,
        "nbytes": 48,
        "chunks": 1,
        "files": ["zoo.safetensors"],
        "subclass": None,
        "error": None,
    }
    assert payload["metadata"] == {"format": "pt", "producer": "tests"}


def test_show_from_a_torch_save_file(torch_save_written: dict) -> None:
    path = torch_save_written["nested"].path
    result = cli("show", str(path), "optimizer.param_groups.0.betas")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "(0.9, 0.95)"


def test_bad_file_error_names_it(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{")
    result = cli("ls", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "broken.safetensors" in result.stderr


# --- check -----------------------------------------------------------------------------------
CHECK_FIELDS = {
    "checkpoint",
    "against",
    "spelling",
    "partial",
    "ok",
    "loadable",
    "counts",
    "missing",
    "unexpected",
    "shape_mismatches",
    "dtype_mismatches",
    "suggestions",
    "after_best",
    "explanation",
}
FACTORIES = """\
import torch
from inspector.demo.model import TinyLlama, TinyLlamaConfig, build_model


def big_vocab():
    return TinyLlama(TinyLlamaConfig(vocab_size=300))


def half():
    assert torch.empty(1).is_meta
    return build_model().to(torch.bfloat16)
"""


def flat_text(result: subprocess.CompletedProcess) -> str:
    """stdout with line wrapping undone."""
    return " ".join(result.stdout.split())


def test_check_against_factory(demo_dir: Path) -> None:
    result = cli(
        "check", str(demo_dir / "prefixed"), "--against", "inspector.demo.model:build_model"
    )
    assert result.returncode == 1, result.stderr
    assert "Best rewrite: strip 'model.'" in flat_text(result)
    lines = result.stdout.splitlines()
    assert "missing from the checkpoint (21):" in lines and "  ... 1 more" in lines
    header = lines.index("suggested rewrites of the checkpoint keys, best first:")
    assert lines[header + 2].split() == ["1", "strip", "'model.'", "42", "0", "0"]
    ok = cli("check", str(demo_dir / "flat"), "--against", "inspector.demo.model:build_model")
    assert ok.returncode == 0 and "Every key, shape and dtype matches." in flat_text(ok)


def test_check_against_path_json(demo_dir: Path) -> None:
    result = cli("check", str(demo_dir / "prefixed"), "--against", str(demo_dir / "flat"), "--json")
    assert result.returncode == 1, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == CHECK_FIELDS
    assert payload["counts"]["missing"] == payload["counts"]["unexpected"] == 21
    assert payload["suggestions"][0]["description"] == "strip 'model.'"
    assert payload["after_best"]["ok"] is True
    assert payload["after_best"]["renamed"]["model.output.weight"] == "output.weight"
    same = cli("check", str(demo_dir / "flat"), "--against", str(demo_dir / "seed"), "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["after_best"] is None


def test_check_user_factory_from_cwd(demo_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "factories.py").write_text(FACTORIES)
    path = str(demo_dir / "prefixed")
    result = cli("check", path, "--against", "factories:big_vocab", "--json", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    after = json.loads(result.stdout)["after_best"]
    assert [m["model"] for m in after["shape_mismatches"]] == [[300, 64], [300, 64]]
    text = flat_text(cli("check", path, "--against", "factories:big_vocab", cwd=tmp_path))
    assert "After it, 2 shape mismatches" in text and "no rename fixes that" in text
    flat = str(demo_dir / "flat")
    strict = cli("check", flat, "--against", "factories:half", cwd=tmp_path)
    assert strict.returncode == 1 and "dtype mismatches (21):" in strict.stdout
    lenient = cli("check", flat, "--against", "factories:half", "--ignore-dtype", cwd=tmp_path)
    assert lenient.returncode == 0, lenient.stderr


def test_check_bad_factory(demo_dir: Path) -> None:
    result = cli("check", str(demo_dir / "flat"), "--against", "no_such_module:build")
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot import 'no_such_module:build'")


# --- audit and fingerprint ------------------------------------------------------------------


def test_audit_exit_codes_and_text(demo_dir: Path, demo_copy) -> None:
    clean = cli("audit", str(demo_dir / "flat"))
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines()[0] == f"{demo_dir / 'flat'} (dcp): OK"
    assert "CRC-32s verified" in clean.stdout.splitlines()[1]
    damaged = demo_copy("flat")
    (damaged / "__1_0.distcp").unlink()
    found = cli("audit", str(damaged))
    assert found.returncode == 1
    assert "PROBLEMS" in found.stdout and "[missing-file] key " in found.stdout
    assert "more (a file the checkpoint names is missing or unusable)" in found.stdout
    (damaged / ".metadata").unlink()  # only rank 0's data is left
    unfinished = cli("audit", str(damaged))
    assert unfinished.returncode == 1
    assert "the save did not finish" in unfinished.stdout
    missing = cli("audit", str(damaged / "nothing"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")


def test_audit_json_shape_and_options(demo_dir: Path) -> None:
    result = cli("audit", str(demo_dir / "seed"), "--json", "--values")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"checkpoint", "format", "ok", "counts", "checked", "problems"}
    assert payload["ok"] is True and payload["format"] == "dcp"
    assert payload["counts"] == {"error": 0, "warning": 0, "info": 1}
    assert payload["problems"] == [
        {
            "key": None,
            "file": None,
            "kind": "model-only",
            "severity": "info",
            "message": payload["problems"][0]["message"],
        }
    ]
    assert payload["checked"]["values"] is True and payload["checked"]["tensors_scanned"] == 21
    quick = json.loads(cli("audit", str(demo_dir / "seed"), "--json", "--no-checksums").stdout)
    assert quick["checked"]["checksums"] is False and quick["checked"]["verified"] == 0
    assert quick["checked"]["records"] == payload["checked"]["records"] > 0


def test_fingerprint_text_json_and_keys(demo_dir: Path) -> None:
    flat = cli("fingerprint", str(demo_dir / "flat"), "--json")
    prefixed = cli("fingerprint", str(demo_dir / "prefixed"), "--json")
    assert flat.returncode == prefixed.returncode == 0, flat.stderr
    a, b = json.loads(flat.stdout), json.loads(prefixed.stdout)
    assert a["digest"] == b["digest"] and a["tensors"].keys() == b["tensors"].keys()
    assert b["tensors"]["norm.weight"]["key"] == "model.norm.weight"
    text = cli("fingerprint", str(demo_dir / "prefixed"), "--tensors", "--keys", "norm.weight")
    lines = text.stdout.splitlines()
    assert lines[0].split()[:3] == [
        inspector.fingerprint(demo_dir / "flat", keys="norm.weight").digest,
        "1",
        "tensors",
    ]
    assert lines[1].split() == ["name", "dtype", "shape", "digest"]
    assert lines[2].split() == [
        "norm.weight",
        "float32",
        "64",
        a["tensors"]["norm.weight"]["digest"],
    ]
    unreadable = cli("fingerprint", str(demo_dir / "nothing"))
    assert unreadable.returncode == 2


def test_diff_with_fingerprints(demo_dir: Path) -> None:
    result = cli("diff", str(demo_dir / "prefixed"), str(demo_dir / "flat"), "--fingerprints")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "347 keys: 347 same"


def test_export_to_a_pt_file_writes_a_pt(demo_dir: Path, tmp_path: Path) -> None:
    import torch

    done = cli("export", str(demo_dir / "seed"), str(tmp_path / "out.pt"))
    assert done.returncode == 0, done.stderr
    assert sorted(torch.load(tmp_path / "out.pt", weights_only=True)) == sorted(
        inspector.open(demo_dir / "seed").keys()
    )
    wrong = cli("export", str(demo_dir / "seed"), str(tmp_path / "x.pt"), "--format", "hf")
    assert wrong.returncode == 2 and "is a .pt file" in wrong.stderr


def test_ls_component_grep_and_sort(demo_dir: Path) -> None:
    path = str(demo_dir / "prefixed")
    ck = inspector.open(path)

    def keys(*options: str) -> list[str]:
        result = cli("ls", path, "--no-scan", *options)
        assert result.returncode == 0, result.stderr
        return [line.split()[0] for line in result.stdout.splitlines()[2:]]

    model = [e.key for e in ck.entries() if e.component == "model"]
    assert keys("--component", "model") == model and len(model) == 21
    assert keys("--grep", r"w[13]\.weight$", "--component", "model") == [
        k for k in model if k.endswith(("w1.weight", "w3.weight"))
    ]
    by_size = keys("--sort", "size")
    sizes = [ck.entry(k).nbytes for k in by_size]
    assert sizes == sorted(sizes, reverse=True) and sorted(by_size) == sorted(ck.keys())
    assert keys("--sort", "key") == sorted(ck.keys())


def test_ls_gives_a_damaged_key_its_reason_in_an_error_column(truncated) -> None:
    path, damaged = truncated
    result = cli("ls", str(path), "--no-scan")
    lines = result.stdout.splitlines()
    assert lines[1].split()[-1] == "error"
    rows = {line.split()[0]: line for line in lines[2:]}
    ck = inspector.open(path)
    for key in damaged:
        why = ck.facts(key).error
        assert why and rows[key].rstrip().endswith(why)
    intact = next(k for k in rows if k not in damaged)
    assert damaged and rows[intact].rstrip().endswith(("B", "KB", "MB"))  # no error text


def test_export_errors_name_the_flag(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "o")
    assert main(["export", str(demo_dir / "flat"), out]) == 0
    assert main(["export", str(demo_dir / "flat"), out]) == 2
    error = capsys.readouterr().err
    assert "pass --overwrite to replace it" in error and "overwrite=True" not in error
