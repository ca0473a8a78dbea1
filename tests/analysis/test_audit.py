"""``inspector.audit`` on real checkpoints with real damage: bytes flipped, files cut short or
missing, saves left unfinished, optimizer state dropped or narrowed, CRCs turned off."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import inspector
from inspector.analysis.findings import KINDS
from inspector.errors import NotACheckpointError
from tests.conftest import run_python
from tests.fixtures.damage import flip_byte, header_of, write_header

WQ = "layers.0.attention.wq.weight"
W1 = "layers.1.feed_forward.w1.weight"


def kinds(report: inspector.AuditReport) -> list[str]:
    return [p.kind for p in report.problems]


def errors(report: inspector.AuditReport) -> list[inspector.analysis.findings.Problem]:
    return [p for p in report.problems if p.severity == "error"]


def drop(state: dict[str, Any], *keys: str) -> None:
    for key in keys:
        del state["optimizer"][key]


# --- genuine checkpoints --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flat", "prefixed", "fp8"])
def test_genuine_training_checkpoints_are_clean(demo_dir: Path, name: str) -> None:
    ck = inspector.open(demo_dir / name)
    report = inspector.audit(ck, values=True)
    assert report.ok and report.problems == ()
    checked = report.checked
    assert checked is not None and checked.files == 2
    assert checked.verified == checked.records > 0 and checked.unchecked == 0
    tensor_bytes = sum(
        r.length for e in ck.entries() if e.kind == "tensor" for r in ck.byte_ranges(e.key) or []
    )
    data = sum((demo_dir / name / f).stat().st_size for f in ("__0_0.distcp", "__1_0.distcp"))
    assert tensor_bytes <= checked.bytes_checksummed <= data
    assert checked.tensors_scanned == sum(e.kind == "tensor" for e in ck.entries()) - 2
    assert "OK" in str(report).splitlines()[0]


def test_seed_checkpoint_is_model_only(demo_dir: Path) -> None:
    report = inspector.audit(demo_dir / "seed")
    assert report.ok and kinds(report) == ["model-only"]
    assert report.problems[0].severity == "info"


def test_convenience_and_function_agree(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    ck = inspector.open(path)
    flip_byte(path / ck.byte_ranges(WQ)[0].name, ck.byte_ranges(WQ)[0].offset)
    assert ck.audit().problems == inspector.audit(ck).problems == inspector.audit(path).problems


# --- integrity ----------------------------------------------------------------------------


def test_flipped_byte_is_a_crc_finding_naming_key_and_file(
    demo_dir: Path, demo_copy: Callable[[str], Path]
) -> None:
    path = demo_copy("flat")
    ck = inspector.open(path)
    where = ck.byte_ranges(WQ)[1]  # rank 1's rows
    flip_byte(path / where.name, where.offset + 37 * 4 + 2)
    report = inspector.audit(path)
    assert not report.ok
    (problem,) = report.problems
    assert (problem.kind, problem.key, problem.file) == ("crc-mismatch", WQ, "__1_0.distcp")
    assert "archive/data/0" in problem.message and "CRC-32" in problem.message
    # everything else still reads; the damaged tensor reads too, one element changed
    damaged = inspector.open(path)
    original = inspector.open(demo_dir / "flat")
    for key in original.keys():
        entry = original.entry(key)
        if entry.kind == "tensor" and key != WQ:
            assert torch.equal(damaged.read(key), original.read(key)), key
    changed = (damaged.read(WQ) != original.read(WQ)).nonzero().tolist()
    rows = original.entry(WQ).chunks[1].offsets[0]
    assert changed == [[rows, 37]]


def test_truncated_shard_names_the_keys_cut_off(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size - 20_000
    os.truncate(shard, size)
    ck = inspector.open(path)
    cut = {
        e.key
        for e in ck.entries()
        for c in e.chunks
        if c.file == shard.name and c.byte_offset + c.byte_length > size
    }
    report = inspector.audit(ck)
    assert cut and {p.key for p in report.by_kind("truncated")} == cut
    assert {p.file for p in report.by_kind("truncated")} == {shard.name}
    assert set(kinds(report)) == {"truncated"}
    assert f"has {size:,} bytes" in report.by_kind("truncated")[0].message
    assert ck.read("norm.weight").shape == (64,) or "norm.weight" in cut


def test_missing_shard_names_every_key_it_held(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    (path / "__1_0.distcp").unlink()
    ck = inspector.open(path)
    held = {e.key for e in ck.entries() if "__1_0.distcp" in e.files}
    report = inspector.audit(ck)
    assert {p.key for p in report.by_kind("missing-file")} == held
    assert set(kinds(report)) == {"missing-file"}
    assert "__1_0.distcp is missing" in report.problems[0].message


def test_torch_save_file_flipped_byte_and_crc_off(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(8)}, "step": 3}
    path = tmp_path / "ck.pt"
    torch.save(state, path)
    ck = inspector.open(path)
    assert kinds(inspector.audit(ck)) == ["model-only"]
    where = ck.byte_ranges("model.w")[0]
    flip_byte(path, where.offset + 5)
    (problem,) = errors(inspector.audit(path))
    assert (problem.kind, problem.key, problem.file) == ("crc-mismatch", "model.w", "ck.pt")
    unchecked = tmp_path / "unchecked.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, unchecked)
    finally:
        torch.serialization.set_crc32_options(True)
    report = inspector.audit(unchecked)
    assert report.ok and kinds(report) == ["unchecked", "model-only"]
    assert report.checked is not None and report.checked.unchecked > 0
    assert torch.equal(inspector.open(unchecked).read("model.w"), state["model"]["w"])


def test_crc_off_dcp_save_is_unchecked_not_damaged(
    resave: Callable[..., Path], flat_state: dict[str, Any]
) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        path = resave("no-crc")
    finally:
        torch.serialization.set_crc32_options(True)
    report = inspector.audit(path)
    assert report.ok
    (note,) = report.problems
    assert (note.kind, note.severity, note.file) == ("unchecked", "info", "__0_0.distcp")
    assert "set_crc32_options(False)" in note.message
    checked = report.checked
    assert checked is not None and checked.unchecked + checked.verified == checked.records
    assert checked.unchecked > checked.verified  # only empty records check out
    # and such a save reads like any other (zipfile alone refuses a CRC of 0)
    assert torch.equal(inspector.open(path).read(WQ), flat_state[WQ])
    assert inspector.open(path).read_object("lr_scheduler.last_epoch") == 2


def test_safetensors_sizes_holes_and_trailing_bytes(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    good = tmp_path / "good.safetensors"
    save_file(tensors, good)
    report = inspector.audit(good)
    assert report.ok and kinds(report) == ["no-checksums", "model-only"]
    assert report.problems[0].message == (
        "2 records in good.safetensors (2 keys) without checksums in this format: "
        "sizes and offsets checked, not the bytes"
    )

    trailing = tmp_path / "trailing.safetensors"
    trailing.write_bytes(good.read_bytes() + b"\0" * 8)
    hole = tmp_path / "hole.safetensors"
    header, data = header_of(good)
    for info in header.values():
        if "data_offsets" in info:
            info["data_offsets"] = [o + 16 for o in info["data_offsets"]]
    write_header(hole, header, b"\0" * 16 + data)
    for path, why in ((trailing, "follow the last tensor"), (hole, "a hole")):
        with pytest.raises(Exception):  # noqa: B017 - safetensors' own loader refuses it
            safe_open(str(path), "pt").keys()
        report = inspector.audit(path)
        (problem,) = errors(report)
        assert problem.kind == "damaged" and why in problem.message, problem

    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-4])
    (problem,) = errors(inspector.audit(cut))
    assert (problem.kind, problem.key) == ("truncated", "b")


def test_chunk_records_cover_what_stored_records_list(tmp_path: Path) -> None:
    """The fallback for a format that lists no records: its chunks, without checksums."""
    from inspector.formats.base import chunk_records

    path = tmp_path / "two.safetensors"
    save_file({"a": torch.arange(6.0), "b": torch.ones(4, dtype=torch.int16)}, path)
    source = inspector.open(path).source
    listed = [(r.key, r.file, r.offset, r.length) for r in source.stored_records()]
    assert [(r.key, r.file, r.offset, r.length) for r in chunk_records(source)] == listed
    assert all(r.crc32 is None for r in chunk_records(source))


def test_sharded_export_missing_shard_and_bad_index_line(demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    inspector.export(demo_dir / "flat", out, max_shard_size="100KB", progress=False)
    assert inspector.audit(out).ok
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    (out / shards[1]).unlink()
    lost = {k for k, v in index["weight_map"].items() if v == shards[1]}
    moved = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][moved] = shards[2]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    report = inspector.audit(out)
    missing = report.by_kind("missing-file")
    assert {p.key for p in missing} == lost | {None}  # None: the shard itself
    assert {p.file for p in missing} == {shards[1]}
    (bad_line,) = report.by_kind("damaged")
    assert (bad_line.key, bad_line.file) == (moved, shards[2])
    assert "does not hold it" in bad_line.message
    assert set(kinds(report)) == {"missing-file", "damaged", "no-checksums", "model-only"}


# --- unfinished saves -----------------------------------------------------------------------


def test_removed_metadata_is_an_unfinished_save(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    (path / ".metadata").unlink()
    with pytest.raises(NotACheckpointError, match="the save did not finish"):
        inspector.open(path)
    report = inspector.audit(path)
    assert report.format is None and report.checked is None and not report.ok
    (problem,) = report.problems
    assert problem.kind == "unfinished"
    size = sum((path / f).stat().st_size for f in ("__0_0.distcp", "__1_0.distcp"))
    assert "no .metadata file" in problem.message
    assert f"2 .distcp files there: ranks 0-1, {size:,} bytes" in problem.message
    assert "the save did not finish" in str(report)


def test_metadata_tmp_without_and_beside_metadata(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    (path / ".metadata").rename(path / ".metadata.tmp")
    (problem,) = inspector.audit(path).problems
    assert problem.kind == "unfinished"
    assert ".metadata.tmp was written but never renamed to .metadata" in problem.message
    shutil.copyfile(path / ".metadata.tmp", path / ".metadata")
    report = inspector.audit(path)
    assert report.ok and kinds(report) == ["leftover"]
    assert report.problems[0].file == ".metadata.tmp"


def test_tmp_folders(demo_copy: Callable[[str], Path], tc_single_written: dict) -> None:
    path = demo_copy("flat")
    (path / "tmp_step_5").mkdir()
    (path / "tmp_step_5" / "model_0.pt").write_bytes(b"partial")
    report = inspector.audit(path)
    assert report.ok and kinds(report) == ["leftover"]
    assert report.problems[0].file == "tmp_step_5"
    # a torch_checkpointing save that never committed, from the library itself
    stuck = tc_single_written["single-uncommitted"].path
    assert stuck.name == "tmp_step_4"
    report = inspector.audit(stuck)
    assert not report.ok and "unfinished" in kinds(report)
    assert any("never renamed to step_4/" in p.message for p in report.problems)


def test_rank_without_its_metadata(resave: Callable[..., Path]) -> None:
    """Saved without collectives each rank writes ``__<r>.metadata``; rank 1's is missing."""
    path = resave("ranked")
    (path / ".metadata").rename(path / "__0.metadata")
    shutil.copyfile(path / "__0_0.distcp", path / "__1_0.distcp")
    report = inspector.audit(path)
    (problem,) = report.by_kind("unfinished")
    assert problem.file == "__1_0.distcp" and "no __1.metadata" in problem.message


# --- completeness and resume readiness -------------------------------------------------------


def test_dropped_optimizer_state_names_the_parameter(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        drop(state, *(f"state.{WQ}.{name}" for name in ("exp_avg", "exp_avg_sq", "step")))
        drop(state, f"state.{W1}.exp_avg_sq")

    report = inspector.audit(resave("dropped", change))
    assert not report.ok and kinds(report) == ["missing-state", "missing-state"]
    first, second = report.problems
    assert first.key == WQ and "exp_avg, exp_avg_sq, step" in first.message
    assert second.key == W1 and "no optimizer exp_avg_sq:" in second.message


def test_frozen_parameters_and_unflattened_optimizer_state(tmp_path: Path) -> None:
    """torch DCP's ``get_optimizer_state_dict`` unflattened: groups list their FQNs, so
    frozen parameters are known; a trained one whose state is gone is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from inspector.demo.model import build_model

    model = build_model()
    model.tok_embeddings.weight.requires_grad_(False)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optim.step()
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim),
    }

    def save(name: str) -> Path:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / name), no_dist=True)
        return tmp_path / name

    assert inspector.audit(save("frozen")).problems == ()
    del state["optimizer"]["state"][WQ]
    (problem,) = inspector.audit(save("dropped")).problems
    assert (problem.kind, problem.key) == ("missing-state", f"model.{WQ}")
    assert "no optimizer exp_avg, exp_avg_sq, step" in problem.message


def test_bf16_moments_are_flagged(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        for key, value in state["optimizer"].items():
            if key.endswith(("exp_avg", "exp_avg_sq")):
                state["optimizer"][key] = value.to(torch.bfloat16)

    report = inspector.audit(resave("bf16-moments", change))
    assert report.ok and kinds(report) == ["dtype"]
    message = report.problems[0].message
    assert "bfloat16 next to float32 parameters (21 parameters" in message


def test_state_shaped_unlike_its_parameter(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        key = f"state.{WQ}.exp_avg"
        state["optimizer"][key] = state["optimizer"][key].reshape(-1)

    (problem,) = inspector.audit(resave("reshaped", change)).problems
    assert (problem.kind, problem.key) == ("state-shape", f"optimizer.state.{WQ}.exp_avg")
    assert "shape [4096], the parameter [64, 64]" in problem.message


def test_missing_components_and_dataloader_ranks(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        del state["lr_scheduler"]
        del state["dataloader"]["dp_rank_0"]
        del state["train_state"]["step"]

    report = inspector.audit(resave("partial", change))
    found = {p.kind: p.message for p in report.problems}
    assert set(kinds(report)) == {"missing-component", "dataloader-ranks"}
    assert any("no lr_scheduler state" in p.message for p in report.problems)
    assert any("train_state has no step" in p.message for p in report.problems)
    assert "ranks [1] but not [0]" in found["dataloader-ranks"]


def test_orphan_optimizer_state(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        state["_orig_mod.norm.weight"] = state.pop("norm.weight")

    report = inspector.audit(resave("renamed", change))
    state, groups = report.by_kind("orphan-state")
    assert state.message.startswith("3 optimizer state entries name parameters the model part")
    assert "optimizer param_groups entries" in groups.message
    assert state.key.startswith("optimizer.state.norm.weight.")
    # no param_groups entry names the renamed weight: not trained, so no missing-state
    assert kinds(report) == ["orphan-state", "orphan-state"]


def test_values_non_finite_and_step_counters(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        state[WQ][0, :3] = float("nan")
        state["optimizer"][f"state.{W1}.exp_avg"][1, 1] = float("inf")
        state["optimizer"][f"state.{W1}.step"] = torch.tensor(1.0)

    path = resave("nan", change)
    assert set(kinds(inspector.audit(path))) == set()  # values are not read by default
    report = inspector.audit(path, values=True)
    non_finite = {p.key: p.message for p in report.by_kind("non-finite")}
    assert non_finite == {
        WQ: "3 NaN and 0 infinite values of 4,096",
        f"optimizer.state.{W1}.exp_avg": "0 NaN and 1 infinite values of 8,192",
    }
    (steps,) = report.by_kind("step-mismatch")
    assert "1 (1 parameters), 2 (20 parameters)" in steps.message


def test_train_step_and_optimizer_steps_disagree(resave: Callable[..., Path]) -> None:
    def change(state: dict[str, Any]) -> None:
        state["train_state"]["step"] = torch.tensor(7, dtype=torch.int32)

    (problem,) = inspector.audit(resave("step", change), values=True).problems
    assert problem.kind == "step-mismatch" and "step is 7" in problem.message


# --- the report --------------------------------------------------------------------------


def test_report_table_json_and_text(demo_copy: Callable[[str], Path]) -> None:
    path = demo_copy("flat")
    ck = inspector.open(path)
    flip_byte(path / ck.byte_ranges(WQ)[0].name, ck.byte_ranges(WQ)[0].offset)
    (path / "tmp_step_9").mkdir()
    report = inspector.audit(ck)
    table = report.table()
    assert list(table.columns) == ["key", "file", "kind", "severity", "message"]
    assert table.to_dict("records")[1] | {"message": None} == {
        "key": WQ,
        "file": "__0_0.distcp",
        "kind": "crc-mismatch",
        "severity": "error",
        "message": None,
    }
    payload = json.loads(json.dumps(report.as_dict()))
    assert payload["ok"] is False and payload["counts"] == {"error": 1, "warning": 1, "info": 0}
    assert set(payload["checked"]) == {
        "checksums",
        "values",
        "files",
        "records",
        "verified",
        "unchecked",
        "without_checksum",
        "bytes_checksummed",
        "tensors_scanned",
    }
    assert [p["kind"] for p in payload["problems"]] == ["leftover", "crc-mismatch"]
    text = str(report)
    assert text.splitlines()[0].endswith("PROBLEMS - 1 error, 1 warning")
    assert f"[crc-mismatch] key {WQ!r} in __0_0.distcp:" in text
    assert all(p.kind in KINDS for p in report.problems)


def test_audit_and_fingerprint_need_no_torch(demo_dir: Path) -> None:
    code = (
        "import json, sys, inspector\n"
        "report = inspector.audit(sys.argv[1])\n"
        "assert report.ok and report.checked.verified, str(report)\n"
        "inspector.fingerprint(sys.argv[1])\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    result = run_python(code, str(demo_dir / "flat"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "false"


def test_checksum_progress_in_bytes_and_cancel(demo_dir: Path) -> None:
    from inspector.progress import Cancelled

    ck = inspector.open(demo_dir / "flat")
    total = sum((demo_dir / "flat" / name).stat().st_size for name in ck.source_files)
    seen: list[tuple[int, int]] = []
    report = inspector.audit(ck, on_progress=lambda done, of: seen.append((done, of)))
    assert report.ok and {of for _, of in seen} == {total}
    assert seen[-1][0] == report.checked.bytes_checksummed
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    cancel = threading.Event()

    def stop_halfway(done: int, of: int) -> None:
        if done > of // 2:
            cancel.set()

    with pytest.raises(Cancelled):
        inspector.audit(ck, on_progress=stop_halfway, cancel=cancel)


def test_the_coverage_line_counts_in_words(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "one.safetensors")
    line = inspector.audit(tmp_path / "one.safetensors").checked.text()
    assert line.startswith("1 file, 1 record, ")  # not "1 files, 1 records"
