"""The app's long jobs, driven in-process: Compare, the Audit tab, Stats with its plots, all
in worker threads with a progress bar and Cancel; the Export tab's HF folder, workers and
remote targets."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.progress import check
from inspector.ui.widgets.app import TABS
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded
from tests.ui.test_app_findings import leaves, opened
from tests.ui.test_widgets import errors_shown, text

WQ = "layers.0.attention.wq.weight"
PNG = b"\x89PNG\r\n\x1a\n"


def test_compare_with_the_prefixed_demo_is_the_same(demo_dir: Path) -> None:
    app = opened(demo_dir / "flat")  # the same training run, saved in the legacy layout
    compare = app.compare
    compare.other.value = str(demo_dir / "prefixed")
    compare.compare_button.click()
    compare.wait()
    assert errors_shown(app) == "" and compare.job.status.value == "done"
    found = compare.comparison
    assert found is not None and found.same and found.fingerprints_equal
    model_keys = {e.key for e in app.ck.entries() if e.component == "model"}
    assert set(found.table["key"]) == model_keys and len(model_keys) == 21
    assert set(found.table["key_b"]) == {f"model.{k}" for k in model_keys}
    shown = text(compare.result)
    assert shown.startswith("same all 21 compared model keys are the same fingerprints equal")
    assert shown.count(" same ") >= 21 and f"{WQ} model.{WQ}" in shown
    assert bytes(compare.plot.value[:8]) == PNG and compare.plot.layout.display == ""


def test_compare_shows_differences_and_refuses_nothing(demo_dir: Path) -> None:
    app = opened(demo_dir / "flat")
    compare = app.compare
    compare.other.value = str(demo_dir / "seed")
    compare.compare_button.click()
    compare.wait()
    found = compare.comparison
    assert found is not None and not found.same and not found.fingerprints_equal
    flat, seed = inspector.open(demo_dir / "flat"), inspector.open(demo_dir / "seed")
    row = found.table.set_index("key").loc[WQ]
    expected = (flat.read(WQ) - seed.read(WQ)).abs().max().item()
    assert row["status"] == "values" and row["max_abs_diff"] == expected
    assert text(compare.result).startswith("different ")
    compare.other.value = " "
    compare.compare_button.click()
    assert "The comparison failed. ValueError: nothing to compare with" in text(
        app.tab_errors["Compare"]
    )
    assert app.errors.value == ""  # shown in its own panel


def test_audit_tab_names_the_flipped_key(flipped: Path) -> None:
    app = opened(flipped)
    assert "audit ok" in text(app.header.found)  # sizes are right: only CRC-32s tell
    app.tabs.selected_index = TABS.index("Audit")
    app.audit.audit_button.click()
    app.audit.wait()
    assert errors_shown(app) == "" and app.audit.job.status.value == "done"
    report = app.audit.report
    assert report is not None and [p.key for p in report.problems] == [WQ]
    shown = text(app.audit.result)
    assert f"keys with errors: {WQ}" in shown and "crc" in shown.lower()
    assert "audit 1 problem (1 error)" in text(app.header.found)  # the header follows
    app.tree.show.value = "errors only"
    assert leaves(app) == [WQ]  # the full audit's errors badge the tree too


def test_stats_run_in_a_worker_with_plots(demo_dir: Path) -> None:
    app = opened(demo_dir / "fp8")
    tensor = app.tensor
    app.tree.select(WQ)
    threads: list[int] = []
    fractions: list[float] = []
    tensor.stats.observe(lambda _: threads.append(threading.get_ident()), "value")
    tensor.job.progress.observe(lambda c: fractions.append(c["new"]), "value")
    tensor.stats_button.click()
    tensor.wait()
    assert threads[-1] != threading.get_ident()  # the result arrived from the worker
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert tensor.job.status.value == "done" and tensor.job.cancel_button.disabled
    numbers = tensor.numbers
    assert numbers is not None and numbers.stats == app.ck.stats(WQ)
    assert int(numbers.histogram.counts.sum()) == 64 * 64
    norms = numbers.norms
    assert norms is not None and list(norms["layer"]) == [0, 1]
    expected = [torch.linalg.vector_norm(app.ck.read(k).double()).item() for k in norms["key"]]
    assert list(norms["l2"]) == pytest.approx(expected, rel=1e-12)
    for image in (tensor.histogram, tensor.norms):
        assert bytes(image.value[:8]) == PNG and image.layout.display == ""


def test_stats_cancel_stops_between_passes(demo_dir: Path) -> None:
    app = opened(demo_dir / "fp8")
    tensor = app.tensor
    app.tree.select(WQ)

    def cancel_on_first_report(change: dict) -> None:
        if change["new"].startswith("statistics"):
            tensor.job.cancel_button.click()

    tensor.job.status.observe(cancel_on_first_report, "value")
    tensor.stats_button.click()
    tensor.wait()
    assert tensor.job.status.value == "cancelled" and tensor.job.progress.bar_style == "warning"
    assert tensor.numbers is None and tensor.histogram.layout.display == "none"
    assert errors_shown(app) == ""


def test_stats_show_numbers_before_the_histogram_and_norms(demo_dir: Path) -> None:
    app = opened(demo_dir / "fp8")
    tensor = app.tensor
    app.tree.select(WQ)
    order: list[str] = []
    tensor.stats.observe(
        lambda c: order.append("numbers") if "statistics" in c["new"] else None, "value"
    )
    tensor.histogram.observe(lambda _: order.append("histogram"), "value")
    tensor.norms.observe(lambda _: order.append("norms"), "value")
    tensor.stats_button.click()
    tensor.wait()
    assert order == ["numbers", "histogram", "norms"]
    assert tensor.numbers is not None and not tensor.numbers.partial


def test_stats_cancel_keeps_what_is_done(demo_dir: Path) -> None:
    app = opened(demo_dir / "fp8")
    tensor = app.tensor
    app.tree.select(WQ)
    tensor.histogram.observe(lambda _: tensor.job.cancel_button.click(), "value")
    tensor.stats_button.click()
    tensor.wait()
    assert tensor.job.status.value == "cancelled"
    numbers = tensor.numbers
    assert numbers is not None and numbers.stats == app.ck.stats(WQ) and numbers.partial
    assert numbers.histogram is not None and tensor.histogram.layout.display == ""
    assert "statistics" in tensor.stats.value and tensor.norms.layout.display == "none"
    assert errors_shown(app) == ""


def test_job_bar_cancel_button_and_failure() -> None:
    errors = ErrorBox()
    bar = JobBar(errors, "The test job")
    started = threading.Event()

    def endless(report, cancel: threading.Event) -> None:
        while True:
            report(1, 2, "working")
            started.set()
            check(cancel)
            cancel.wait(0.01)

    results: list[object] = []
    bar.run(endless, results.append)
    assert started.wait(10) and not bar.cancel_button.disabled
    bar.cancel_button.click()
    bar.wait(10)
    assert bar.status.value == "cancelled" and results == [] and errors.value == ""

    def broken(report, cancel: threading.Event) -> None:
        raise ValueError("no such thing")

    bar.run(broken, results.append)
    bar.wait(10)
    assert bar.status.value == "failed" and bar.progress.bar_style == "danger"
    assert "The test job failed. ValueError: no such thing" in text(errors)
    bar.run(lambda report, cancel: 42, results.append)
    bar.wait(10)
    assert results == [42] and bar.status.value == "done" and bar.progress.value == 1.0


def test_hf_export_arch_auto_and_workers(demo_dir: Path, tmp_path: Path) -> None:
    app = opened(demo_dir / "fp8")
    export = app.export
    assert export.arch.layout.display == "none" and export.workers.value == 1
    assert export.dtype.label == "as stored" and export._read_form().dtype is None
    export.format.value = "hf"
    assert export.arch.value == "auto" and export.hf_config.layout.display == ""
    note = text(export.arch_note)
    assert note.startswith("arch auto llama3: all 21 model weights") and "July-2025" in note
    export.workers.value = 3
    export.out.value = str(tmp_path / "hf")
    assert "workers" not in export._read_form().arguments()  # an HF folder: one process
    export.format.value = "safetensors"
    assert export._read_form().arguments()["workers"] == 3  # passed on to inspector.export
    export.format.value = "hf"
    export.fp8.value = "unwrap"
    config = json.loads((demo_dir / "llama_hf" / "assets" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    export.hf_config.value = str(tmp_path / "config.json")
    export.export_button.click()
    export.wait()
    assert "verified 21 tensors bit-exact" in text(export.outcome)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(
        weights["model.layers.0.self_attn.o_proj.weight"],
        app.ck.read("layers.0.attention.wo.weight"),
    )


def test_export_to_a_remote_target(s3_server: CountedServer, demo_dir: Path) -> None:
    source = uploaded(s3_server, demo_dir / "fp8", "fp8")
    app = opened(source, storage_options=s3_server.storage_options)
    target = s3_server.address("remote-tests/exports/app-fp8")
    app.export.out.value = target
    app.export.overwrite.value = True
    app.export.export_button.click()
    app.export.wait()
    assert errors_shown(app) == "", errors_shown(app)
    assert "verified 21 tensors bit-exact" in text(app.export.outcome)
    exported = inspector.open(target, s3_server.storage_options)
    assert exported.format == "safetensors" and len(exported.keys()) == 21
    assert torch.equal(exported.read(WQ), app.ck.read(WQ))


def test_compare_with_a_url(s3_server: CountedServer, demo_dir: Path) -> None:
    url = uploaded(s3_server, demo_dir / "prefixed", "prefixed")
    app = opened(demo_dir / "flat", storage_options=s3_server.storage_options)
    app.compare.other.value = url
    app.compare.compare_button.click()
    app.compare.wait()
    found = app.compare.comparison
    assert errors_shown(app) == "" and found is not None and found.b == url
    assert found.same and found.fingerprints_equal and len(found.table) == 21
