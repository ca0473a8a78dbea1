"""The app's header of findings and the tree's badges, driven in-process: what shows before
the first click, and what each finding's button does."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inspector.demo.model import build_model
from inspector.ui.widgets import Inspector
from inspector.ui.widgets.app import TABS
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded
from tests.ui.test_widgets import errors_shown, text

WQ = "layers.0.attention.wq.weight"


def opened(path: Path | str, **kwargs: object) -> Inspector:
    app = Inspector(path, **kwargs)  # type: ignore[arg-type]
    app.header.wait()
    assert errors_shown(app) == "", errors_shown(app)
    return app


def leaves(app: Inspector) -> list[str]:
    """The keys of the tree's leaf rows as shown."""
    return [
        prefix
        for _, (kind, prefix) in app.tree.tree.options
        if kind == "node" and app.tree.outline.node(prefix).entry is not None
    ]


def label(app: Inspector, prefix: str) -> str:
    return next(lb for lb, v in app.tree.tree.options if v == ("node", prefix)).replace("\xa0", " ")


def test_fp8_finding_and_convert_button_export_plain_weights(
    demo_dir: Path, tmp_path: Path
) -> None:
    app = Inspector(demo_dir / "fp8")
    first = text(app.header.found)
    assert "layout flat:" in first and "FP8" not in first.split()  # metadata only, at once
    app.header.wait()
    found = text(app.header.found)
    assert found.startswith("FP8 14 WeightWithDynamicFloat8CastTensor (FP8 training wrapper)")
    assert "dcp_to_torch_save" in found and "unless torchao is installed" in found
    assert "Fix: Export with fp8='unwrap'" in found
    assert "audit ok" in found and "producer written by torchtitan, step 2" in found
    assert app.header.scan.status.value == "done" and app.header.scan.progress.value == 1.0
    button = app.header.fp8_button
    assert button.layout.display == "" and button.description == "Convert FP8 and export"
    assert app.header.fix_button.layout.display == "none"
    button.click()
    export = app.export
    assert app.tabs.selected_index == TABS.index("Export")
    assert (export.format.value, export.fp8.value, export.model_only.value) == (
        "safetensors",
        "unwrap",
        True,
    )
    assert "preset 14 FP8 tensors found. FP8: unwrap" in text(export.preset)
    export.out.value = str(tmp_path / "plain")
    export.export_button.click()
    export.wait()
    assert "verified 21 tensors bit-exact" in text(export.outcome)
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    assert sorted(tensors) == sorted(build_model().state_dict())
    for key, value in tensors.items():
        assert type(value) is torch.Tensor and torch.equal(value, app.ck.read(key)), key


def test_prefixed_layout_says_what_fails_and_fixes_it(demo_dir: Path, tmp_path: Path) -> None:
    app = opened(demo_dir / "prefixed")
    found = text(app.header.found)
    assert "layout prefixed: model weights under 'model.'" in found
    assert "reports every model key missing (e.g. 'tok_embeddings.weight')" in found
    assert "Fix: Rewrite strip 'model.': it resolves 42 of 42 key mismatches" in found
    assert app.header.fp8_button.layout.display == "none"
    app.header.fix_button.click()
    assert app.tabs.selected_index == TABS.index("Export")
    assert text(app.export.rename) == "Rename: strip 'model.' (21 keys renamed)"
    app.export.out.value = str(tmp_path / "fixed")
    app.export.export_button.click()
    app.export.wait()
    model = build_model(seed=3)
    model.load_state_dict(load_file(tmp_path / "fixed" / "model.safetensors"), strict=True)
    assert torch.equal(model.output.weight, app.ck.read("model.output.weight"))


def test_audit_finding_names_the_key_and_links_to_the_tab(
    truncated: tuple[Path, set[str]],
) -> None:
    path, cut = truncated
    app = opened(path)
    found = text(app.header.found)
    assert cut == {"output.weight"} and "audit 1 problem (1 error)" in found
    first = app.header.findings.audit.problems[0]
    assert first.key in cut and f"key {first.key!r}" in found
    app.header.audit_button.click()
    assert app.tabs.selected_index == TABS.index("Audit")
    shown = text(app.audit.result)
    assert shown.startswith("problems 1 problem (1 error)") and first.key in shown
    app.tree.show.value = "errors only"
    assert set(leaves(app)) == cut
    assert label(app, first.key).endswith("[error]")


def test_tree_badges_and_fp8_filter(demo_dir: Path) -> None:
    app = opened(demo_dir / "fp8")
    wrapped = {k for k in app.ck.keys() if app.ck.facts(k).subclass}
    assert len(wrapped) == 14
    app.tree.select(WQ)
    assert label(app, WQ).endswith("[FP8]") and "float32" in label(app, WQ)
    assert label(app, "layers").endswith("[14 FP8]")
    assert label(app, "layers.0.attention").endswith("[4 FP8]")  # wq, wk, wv, wo
    assert "[" not in label(app, "layers.0.attention_norm")  # plain weights
    app.tree.filter.value = WQ
    assert label(app, "layers").endswith("[1 FP8]")  # counted among the keys kept
    app.tree.filter.value = ""
    app.tree.show.value = "FP8 only"
    assert set(leaves(app)) == wrapped and "14 of 347 keys match" in text(app.tree.status)
    app.tree.show.value = "errors only"
    assert leaves(app) == [] and "0 of 347 keys match" in text(app.tree.status)
    app.tree.show.value = "all keys"
    assert "347 keys" in text(app.tree.status)


def test_run_root_step_picker_opens_another_step(run_root: Path) -> None:
    app = opened(run_root)
    assert "producer written by torchtitan, step 10, step-10 of 2 saved steps" in text(
        app.header.found
    )
    picker = app.header.steps
    assert picker.layout.display == ""
    assert [label for label, _ in picker.options] == [
        "step 9 (step-9)",
        "step 10 (step-10) - open",
    ]
    picker.value = picker.options[0][1]
    app.header.wait()
    assert errors_shown(app) == "" and app.ck.layout == "model-only"
    assert app.ck.location == str(run_root / "step-9")
    assert [label for label, _ in app.header.steps.options] == [
        "step 9 (step-9) - open",
        "step 10 (step-10)",
    ]
    assert "layout model-only" in text(app.header.found)


def test_remote_location_and_bytes_read(s3_server: CountedServer, demo_dir: Path) -> None:
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    app = opened(url, storage_options=s3_server.storage_options)
    where = text(app.header.where)
    assert where.startswith(f"{url} · read so far: ")
    before = app.ck.io.requests
    app.tree.select(WQ)
    app.tensor.stats_button.click()
    app.tensor.wait()
    assert app.ck.io.requests > before
    io = app.ck.io
    assert text(app.header.where).endswith(f"in {io.requests:,} requests")


def test_findings_run_off_the_kernel_thread(demo_dir: Path) -> None:
    app = Inspector(demo_dir / "fp8")
    threads: list[int] = []
    app.header.found.observe(lambda _: threads.append(threading.get_ident()), "value")
    app.header.wait()
    assert threads and threading.get_ident() not in threads


@pytest.mark.parametrize("name", ["flat", "seed"])
def test_no_fp8_no_button(demo_dir: Path, name: str) -> None:
    app = opened(demo_dir / name)
    assert "FP8 no FP8 or subclass tensors in 21 scanned" in text(app.header.found)
    assert app.header.fp8_button.layout.display == "none"


def test_quantized_payloads_are_dequantized(tmp_path: Path) -> None:
    from tests.fixtures import fp8_checkpoints as fx

    made = fx.payloads(fx.weight())
    objects = {WQ: made["f8_row"], "layers.0.attention.wk.weight": made["f8_tensor"]}
    torch.save({**objects, "norm.weight": torch.ones(8)}, tmp_path / "quantized.pt")
    app = opened(tmp_path / "quantized.pt")
    found = text(app.header.found)
    assert found.startswith("FP8 2 Float8Tensor (quantized payload)")
    assert "Fix: Export with fp8='dequantize'" in found
    assert label(app, "layers").endswith("[2 FP8]")
    app.header.fp8_button.click()
    assert app.export.fp8.value == "dequantize"
    app.export.out.value = str(tmp_path / "plain")
    app.export.export_button.click()
    app.export.wait()
    assert "verified 3 tensors" in text(app.export.outcome), text(app.export.outcome)
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    for key, obj in objects.items():
        assert torch.equal(tensors[key], fx.torchao_dequantized(obj)), key
