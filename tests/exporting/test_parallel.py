"""Scale-out export: worker processes and torchrun ranks write the bytes one process writes,
and a failure anywhere leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import inspector
from inspector.errors import CorruptCheckpointError, ExportError, InspectorError
from inspector.exporting.shares import FileTask, balance

# (name, source demo, options): sharded, one file, .pt, FP8 training weights (torchao's
# float8 wrapper, fp8='dequantize' unwraps the master weight) cast to bfloat16
CASES = [
    ("sharded", "flat", {"max_shard_size": "100KB"}),
    ("single.safetensors", "flat", {}),
    ("flat.pt", "prefixed", {"format": "pt"}),
    ("fp8", "fp8", {"dtype": "bfloat16", "max_shard_size": "200KB"}),
]

RANKS_SCRIPT = """
import sys
import torch.distributed as dist
import inspector
dist.init_process_group("gloo")
demo, out = sys.argv[1], sys.argv[2]
for name, source, options in eval(sys.argv[3]):
    result = inspector.export(f"{demo}/{source}", f"{out}/{name}", progress=False,
                              distributed=True, **options)
    assert result.verification.ok, result.verification
dist.destroy_process_group()
"""


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) by relative name."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))}


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def references(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each case exported by one process: the bytes every other way must reproduce."""
    out = tmp_path_factory.mktemp("one-process")
    found = {}
    for name, source, options in CASES:
        result = inspector.export(demo_dir / source, out / name, progress=False, **options)
        assert result.verification.ok
        found[name] = tree_bytes(out / name)
    assert len(found["sharded"]) == 6 and len(found["fp8"]) > 2  # 5 shards + index; shards
    return found


def test_two_workers_write_identical_bytes(
    demo_dir: Path, tmp_path: Path, references: dict[str, dict]
) -> None:
    seen: list[inspector.exporting.run.Progress] = []
    for name, source, options in CASES:
        result = inspector.export(
            demo_dir / source, tmp_path / name, progress=False, workers=2,
            on_progress=seen.append, **options,
        )
        assert tree_bytes(tmp_path / name) == references[name], name
        assert result.verification.ok and result.verification.checked == result.tensors == 21
        if name == "fp8":
            assert all("bfloat16" in c for c in result.conversions.values())
            assert any(c.startswith("unwrap WeightWithDynamicFloat8CastTensor")
                       for c in result.conversions.values())
    writes = [p for p in seen if p.phase == "write"]
    assert writes[-1].done == writes[-1].total > 0  # the workers' tensors reached the one meter
    assert not [p for p in tmp_path.rglob("*") if ".inspector-" in p.name]


def test_torchrun_ranks_write_identical_bytes(
    demo_dir: Path, tmp_path: Path, references: dict[str, dict]
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    done = torchrun(str(script), str(demo_dir), str(tmp_path / "out"), repr(CASES))
    assert done.returncode == 0, done.stderr[-3000:]
    for name, _, _ in CASES:
        assert tree_bytes(tmp_path / "out" / name) == references[name], name


def _truncated(demo_copy) -> tuple[Path, str]:
    source = demo_copy("flat")
    shard = source / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    return source, shard.name


def _damaged_record(demo_copy) -> tuple[Path, str]:
    """A chunk whose zip record header is broken: planning passes, only its read fails."""
    from inspector.formats.torch_archive import TorchArchive
    from inspector.storage import LocalStorage

    source = demo_copy("seed")
    chunk = inspector.open(source).entry("layers.0.attention.wv.weight").chunks[0]
    with LocalStorage(source).window(chunk.file, chunk.byte_offset, chunk.byte_length) as item:
        archive = TorchArchive(item, chunk.file, chunk.byte_length, "k")
        header = archive._infos[archive.prefix + "data/0"].header_offset
    with open(source / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset + header)
        f.write(b"XXXX")
    return source, chunk.file


def test_a_failing_worker_fails_the_export_and_leaves_nothing(
    demo_copy, tmp_path: Path
) -> None:
    source, shard = _truncated(demo_copy)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=rf"{shard}.*file truncated"):
        inspector.export(source, out / "t", max_shard_size="100KB", workers=2, progress=False)
    damaged, file = _damaged_record(demo_copy)
    for name, options in (("sh", {"max_shard_size": "100KB"}), ("x.pt", {"format": "pt"}),
                          ("one.safetensors", {})):
        with pytest.raises(CorruptCheckpointError, match=rf"{file}.*wv\.weight.*bad local header"):
            inspector.export(damaged, out / name, workers=2, progress=False, **options)
    assert not out.exists() or leftovers(out) == []  # no final files, temporaries or index


def test_skip_mode_with_workers_matches_one_process(demo_copy, tmp_path: Path) -> None:
    damaged, _ = _damaged_record(demo_copy)
    for workers in (1, 2):
        result = inspector.export(damaged, tmp_path / f"{workers}.pt", format="pt",
                                  on_error="skip", workers=workers, progress=False)
        assert list(result.skipped) == ["layers.0.attention.wv.weight"]
        assert result.tensors == 20 and result.verification.ok
    assert (tmp_path / "1.pt").read_bytes() == (tmp_path / "2.pt").read_bytes()


def test_torchrun_rank_failure_fails_every_rank(demo_copy, tmp_path: Path) -> None:
    damaged, file = _damaged_record(demo_copy)
    out = tmp_path / "out"
    done = torchrun("-m", "inspector", "export", str(damaged), str(out), "--max-shard-size",
                    "100KB")
    assert done.returncode != 0
    # Each rank prints its own "error: ..." line; two ranks' lines may interleave.
    failures = [m for m in done.stderr.split("error: ")[1:] if "bad local header" in m]
    assert len(failures) >= 2 and all(file in m for m in failures), done.stderr[-3000:]
    assert any(m.startswith(("rank 0: ", "rank 1: ")) for m in failures)
    assert "exitcode  : 2" in done.stderr or "exit code 2" in done.stderr.lower()
    assert not out.exists() or leftovers(out) == []


def test_errors_survive_pickling() -> None:
    import pickle

    error = CorruptCheckpointError("broken", file="/x/__0_0.distcp", key="w")
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.file, back.key, back.reason) == (
        CorruptCheckpointError, str(error), "/x/__0_0.distcp", "w", "broken"
    )
    found = pickle.loads(pickle.dumps(inspector.errors.UnfinishedSaveError("x", found=("a",))))
    assert found.found == ("a",) and isinstance(found, InspectorError)


def test_shards_are_dealt_by_bytes_deterministically() -> None:
    def task(n: int, size: int) -> FileTask:
        return FileTask(f"f{n}", ((f"t{n}", "uint8", (size,)),), {}, True, "fail")

    tasks = [task(0, 10), task(1, 70), task(2, 30), task(3, 40)]
    shares = balance(tasks, 2)
    assert [[t.path for t in s] for s in shares] == [["f0", "f1"], ["f2", "f3"]]  # 80 | 70
    assert balance(tasks, 2) == shares


def test_model_folder_formats_say_why_they_use_one_process(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(inspector.errors.UsageError, match="one process"):
        inspector.export(demo_dir / "flat", tmp_path / "hf", format="hf", workers=2)
    with pytest.raises(inspector.errors.UsageError, match="at least 1"):
        inspector.export(demo_dir / "flat", tmp_path / "x", workers=0, progress=False)


def test_cli_workers(demo_dir: Path, tmp_path: Path, references: dict[str, dict]) -> None:
    from tests.ui.test_cli import cli

    out = tmp_path / "sharded"
    done = cli("export", str(demo_dir / "flat"), str(out), "--max-shard-size", "100KB",
               "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert "verified 21 tensors bit-exact" in done.stdout
    assert tree_bytes(out) == references["sharded"]
