"""The header's findings: FP8 wrappers and what torch does with them, the layout with its
consequence and fix, the audit's verdict, producer and step; metadata first, the rest after."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import inspector
from inspector.demo.model import build_model
from inspector.ui.views import findings
from inspector.ui.views.findings import Finding, at_once, find
from inspector.ui.views.text import human_bytes

WQ = "layers.0.attention.wq.weight"


def found(ck: inspector.Checkpoint) -> tuple[findings.Findings, list[tuple[int, int, str]]]:
    reports: list[tuple[int, int, str]] = []
    return find(ck, lambda d, t, text: reports.append((d, t, text)), threading.Event()), reports


def test_metadata_first_then_fp8_wrappers(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "fp8")
    first = at_once(ck)
    assert first.fp8 is None and first.audit is None and not first.complete
    assert [f.topic for f in first.lines()] == ["layout", "producer"]
    assert ck.scanned(WQ) is None  # nothing was scanned for the first view
    early: list[findings.Findings] = []
    reports: list[tuple[int, int, str]] = []
    everything = find(
        ck, lambda d, t, text: reports.append((d, t, text)), threading.Event(), early.append
    )
    assert everything.complete and reports[-1] == (1, 1, "done")
    [before_audit] = early  # FP8 and layout first: the audit's many small reads come after
    assert before_audit.fp8 == everything.fp8 and before_audit.audit is None
    assert [r[0] for r in reports[:21]] == list(range(1, 22))  # one report per model tensor
    fp8 = everything.fp8
    assert fp8 is not None and (fp8.scanned, fp8.count, fp8.scaled) == (21, 14, 0)
    assert dict(fp8.wrappers) == {"WeightWithDynamicFloat8CastTensor": 14}
    assert not fp8.payloads and not fp8.unknown and fp8.mode == "unwrap"
    wrapped = {k for k in ck.keys() if ck.facts(k).subclass}
    assert set(fp8.keys) == wrapped and len(wrapped) == 14 and WQ in wrapped
    line = fp8.finding()
    assert (line.tone, line.title) == (
        "warn",
        "14 WeightWithDynamicFloat8CastTensor (FP8 training wrapper)",
    )
    assert "dcp_to_torch_save" in line.consequence and "unless torchao is installed" in (
        line.consequence
    )  # tests/exporting/test_run.py::test_seed_failure_fixed runs torch's converter on it
    assert line.fix is not None and line.fix.startswith("Export with fp8='unwrap'")
    assert [f.topic for f in everything.lines()] == ["fp8", "layout", "audit", "producer"]
    assert everything.producer.title == "written by torchtitan, step 2"


def test_prefixed_layout_says_what_fails_and_the_rewrite(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    assert at_once(ck).layout.report is None  # the doctor runs in the worker
    layout = found(ck)[0].layout
    assert layout.report is not None and layout.report.best is not None
    assert layout.report.best.description == "strip 'model.'"
    line = layout.finding()
    assert line.tone == "warn" and line.title.startswith("prefixed: model weights under 'model.'")
    assert "reports every model key missing (e.g. 'tok_embeddings.weight')" in line.consequence
    assert line.fix == (
        "Rewrite strip 'model.': it resolves 42 of 42 key mismatches (the Export tab applies it)."
    )
    model = build_model()
    with pytest.raises(CheckpointException) as failed:  # what the finding says
        dcp.load(model.state_dict(), checkpoint_id=demo_dir / "prefixed", no_dist=True)
    told = "".join(traceback.format_exception(failed.value))
    assert "Missing key in checkpoint state_dict: " in told
    renamed = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(renamed, checkpoint_id=demo_dir / "prefixed", no_dist=True)  # after the rewrite
    assert torch.equal(renamed[f"model.{WQ}"], ck.read(f"model.{WQ}"))


def test_flat_seed_and_wrapped_layouts(demo_dir: Path, tmp_path: Path) -> None:
    flat = findings.layout_facts(inspector.open(demo_dir / "flat"))
    assert flat.report is None and flat.finding() == Finding(
        "layout",
        "ok",
        "flat: model weights at top level beside prefixed components: torchtitan's current layout",
        "Loads into current torchtitan as it is.",
    )
    seed = findings.layout_facts(inspector.open(demo_dir / "seed")).finding()
    assert seed.tone == "info" and "nothing to resume from" in seed.consequence
    compiled = {f"_orig_mod.{k}": v for k, v in build_model().state_dict().items()}
    dcp.save(compiled, storage_writer=dcp.FileSystemWriter(tmp_path / "c"), no_dist=True)
    wrapped = findings.layout_facts(inspector.open(tmp_path / "c"))
    assert wrapped.wrappers == ("_orig_mod.",) and wrapped.report is not None
    line = wrapped.finding()
    assert line.tone == "warn" and "'_orig_mod.' (torch.compile)" in line.consequence
    assert line.fix is not None and line.fix.startswith(
        "Rewrite strip '_orig_mod.': it resolves 42"
    )


def test_audit_verdicts(demo_dir: Path, truncated: tuple[Path, set[str]]) -> None:
    ok = findings.audit_finding(inspector.audit(demo_dir / "flat", checksums=False))
    assert (ok.tone, ok.title) == ("ok", "ok") and "CRC-32s not checked" in ok.consequence
    path, cut = truncated
    report = found(inspector.open(path))[0].audit
    assert report is not None and {p.key for p in report.problems} == cut
    line = findings.audit_finding(report)
    first = report.problems[0]
    assert cut == {"output.weight"}
    assert line.tone == "bad" and line.title == "1 problem (1 error)"
    assert line.consequence == f"key {first.key!r}: {first.message}"
    seed = findings.audit_finding(inspector.audit(demo_dir / "seed", checksums=False))
    assert seed.tone == "ok"  # "weights only" is a note, not a problem


def test_producer_and_step_of_a_run(run_root: Path) -> None:
    ck = inspector.open(run_root)
    assert at_once(ck).producer.title == "written by torchtitan, step 10, step-10 of 2 saved steps"
    assert findings.saved_step(ck) == 10
    older = inspector.open(ck.steps[0].location)  # the seed: no train_state, no run folder
    assert findings.saved_step(older) is None
    # model weights alone name no trainer: torch DCP's own
    assert findings.producer_finding(older, None).title == "written by torch-dcp"


def test_location_and_bytes_read(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    before = findings.location_text(ck)
    assert before.startswith(f"{demo_dir / 'flat'} · read from disk so far: ")
    ck.read(WQ)
    after = findings.location_text(ck)
    assert after != before and after.endswith(human_bytes(ck.io.bytes))
    assert "requests" not in after  # worded for a local file


def test_cancel_stops_the_scan(demo_dir: Path) -> None:
    from inspector.progress import Cancelled

    ck = inspector.open(demo_dir / "fp8")
    cancel = threading.Event()

    def stop(done: int, total: int, text: str) -> None:
        if done == 3:
            cancel.set()

    with pytest.raises(Cancelled):
        find(ck, stop, cancel)
    scanned = [k for k in findings.model_tensors(ck) if ck.scanned(k) is not None]
    assert len(scanned) == 3
