"""The Jupyter app driven in-process: set widget values, click buttons, read what they show."""

from __future__ import annotations

import gc
import html
import json
import re
import weakref
from pathlib import Path

import ipywidgets as w
import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.demo.model import build_model
from inspector.exporting.request import OPTION
from inspector.ui.views.text import human_bytes
from inspector.ui.widgets import Inspector
from inspector.ui.widgets.app import TABS
from inspector.ui.widgets.export import ExportPanel

WQ = "layers.0.attention.wq.weight"


def errors_shown(app: Inspector) -> str:
    """Every error box of the app: above the panels and in each tab."""
    boxes = [app.errors, *getattr(app, "tab_errors", {}).values()]
    return "".join(box.value for box in boxes)


def text(widget: w.Widget) -> str:
    """A widget's HTML (a box's: its shown HTML and labels) as plain text: tags dropped,
    entities decoded, spaces collapsed."""
    if isinstance(widget, w.Box):
        shown = (c for c in widget.children if c.layout.display != "none")
        return " ".join(filter(None, (text(c) for c in shown)))
    value = widget.value if isinstance(widget, w.HTML | w.Label) else ""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", value)).split())


def shown_prefixes(app: Inspector) -> list[str]:
    return [prefix for kind, prefix in (v for _, v in app.tree.tree.options) if kind == "node"]


def top_level(app: Inspector) -> list[str]:
    return [prefix for prefix in shown_prefixes(app) if "." not in prefix]


@pytest.fixture
def fp8_app(demo_dir: Path) -> Inspector:
    app = Inspector(demo_dir / "fp8")
    app.header.wait()  # the findings' worker is done: nothing changes behind the test's back
    return app


def test_header_counts_one_of_a_kind_in_the_singular(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    app = Inspector(tmp_path)
    app.header.wait()
    header = text(app.header)
    assert "· 1 key ·" in header and "· 2 files ·" in header and "· 1 rank" in header
    assert "3 parameters" in header and "1 keys" not in header and "1 ranks" not in header
    app.tree.select("w")
    assert "1 key," not in text(app.tensor.details)


def test_lazy_export_and_header(demo_dir: Path, fp8_app: Inspector) -> None:
    assert inspector.Inspector is Inspector
    header = text(fp8_app.header)
    assert str(demo_dir / "fp8") in header
    assert "dcp" in header and "flat" in header and "torchtitan's current layout" in header
    assert "347 keys" in header and "3 files" in header and "2 ranks" in header
    assert "115,008 parameters" in header
    assert re.search(r"optimizer\s+315\s+230,037\s+1\.2 MB", header)
    assert errors_shown(fp8_app) == "" and fp8_app.ck.path == demo_dir / "fp8"
    again = Inspector(fp8_app.ck)
    assert again.ck is fp8_app.ck and text(again.header.totals) == text(fp8_app.header.totals)


def test_bad_path_is_explained_and_can_be_fixed(demo_dir: Path, tmp_path: Path) -> None:
    app = Inspector(tmp_path / "nothing-here")
    message = text(app.errors)
    assert "Opening the checkpoint failed." in message and str(tmp_path / "nothing-here") in message
    assert "Traceback" not in message and app.body.children == () and app.ck is None
    assert repr(app) == f"<Inspector: {tmp_path / 'nothing-here'} not open>"
    app.path.value = str(demo_dir / "seed")
    app.open_button.click()
    assert errors_shown(app) == "" and app.ck.layout == "model-only"
    assert repr(app) == f"<Inspector {app.ck!r}>"
    assert "model-only" in text(app.header)
    opened = app.ck
    app.path.value = str(tmp_path / "still-nothing")
    app.open_button.click()  # a failed Open keeps the checkpoint shown, the error above it
    assert str(tmp_path / "still-nothing") in text(app.errors) and app.ck is opened
    assert "model-only" in text(app.header) and app.body.children == (app.header, app.tabs)
    assert app.opening.value == ""


def test_reopening_and_closing_free_the_checkpoint(demo_dir: Path) -> None:
    app = Inspector(demo_dir / "fp8")
    first = weakref.ref(app.ck)
    app.path.value = str(demo_dir / "flat")
    app.open_button.click()
    gc.collect()
    assert first() is None and app.ck.layout == "flat"
    second = weakref.ref(app.ck)
    app.close()
    del app
    gc.collect()
    assert second() is None


def test_tree_expands_and_views_respell(fp8_app: Inspector) -> None:
    tree = fp8_app.tree
    assert top_level(fp8_app) == [c.name for c in fp8_app.ck.tree().children()]
    tree.tree.value = ("node", "layers")
    assert shown_prefixes(fp8_app)[3:6] == ["layers", "layers.0", "layers.1"]
    tree.select(WQ)
    assert tree.tree.value == ("node", WQ) and tree.outline.is_expanded("layers.0.attention")
    tree.view.value = "prefixed"
    assert tree.selected == f"model.{WQ}" and tree.tree.value == ("node", f"model.{WQ}")
    assert "model" in top_level(fp8_app) and "layers" not in top_level(fp8_app)
    assert text(fp8_app.tensor.details).split()[0] == f"model.{WQ}"
    assert f"stored key {WQ}" in text(fp8_app.tensor.details)
    tree.view.value = "flattened"
    assert tree.selected == WQ and "layers" in top_level(fp8_app)


def test_filter_modes_and_bad_regex(fp8_app: Inspector) -> None:
    tree = fp8_app.tree
    keys = fp8_app.ck.keys()
    tree.filter.value = "WQ.Weight"
    matching = [k for k in keys if "wq.weight" in k]
    assert f"{len(matching)} of 347 keys match" in text(tree.status)
    assert set(matching) <= set(shown_prefixes(fp8_app))
    tree.mode.value = "glob"
    assert "0 of 347 keys match" in text(tree.status) and tree.tree.options == ()
    tree.filter.value = "*.wq.weight"
    layer = ["", ".attention", ".attention.wq", ".attention.wq.weight"]
    assert shown_prefixes(fp8_app) == [
        "layers",
        *(f"layers.0{part}" for part in layer),
        *(f"layers.1{part}" for part in layer),
    ]
    tree.mode.value = "regex"
    tree.filter.value = "layers.(0"
    assert "Filtering failed." in text(fp8_app.tab_errors["Keys"])
    assert "not a valid regular expression 'layers.(0'" in text(fp8_app.tab_errors["Keys"])
    tree.filter.value = r"^layers\.1\..*w3"
    assert errors_shown(fp8_app) == "" and "1 of 347 keys match" in text(tree.status)


def test_collapse_and_paged_children(fp8_app: Inspector) -> None:
    tree = fp8_app.tree
    tree.select("layers.0.attention")
    tree.collapse_button.click()
    assert tree.selected == "layers.0.attention"
    assert not tree.outline.is_expanded("layers.0.attention")
    tree.collapse_button.click()
    assert tree.selected == "layers.0" and not tree.outline.is_expanded("layers.0")
    tree.collapse_all_button.click()
    assert tree.selected == "" and all("." not in p for p in shown_prefixes(fp8_app))
    tree.children_page = 2
    tree.rebuild()
    label, value = tree.tree.options[-1]
    assert top_level(fp8_app) == ["optimizer", "dataloader"] and value == ("more", "")
    assert "... 6 more: select to list 2" in label.replace("\xa0", " ")
    tree.tree.value = value
    assert len(top_level(fp8_app)) == 4 and tree.tree.value is None
    assert "... 4 more" in tree.tree.options[-1][0].replace("\xa0", " ")


def test_entry_table_pages(fp8_app: Inspector) -> None:
    tree = fp8_app.tree
    assert "all keys: entries 1-50 of 347" in text(tree.entries)
    assert tree.prev_button.disabled and not tree.next_button.disabled
    tree.next_button.click()
    assert "entries 51-100 of 347" in text(tree.entries) and tree.page_label.value == "page 2 of 7"
    for _ in range(10):
        tree.next_button.click()
    assert "entries 301-347 of 347" in text(tree.entries) and tree.next_button.disabled
    tree.select("layers.1")
    table = text(tree.entries)
    assert "layers.1: entries 1-9 of 9" in table
    row = "layers.1.attention.wk.weight float32 64x64 16.4 KB 2 WeightWithDynamicFloat8CastTensor"
    assert row in table


def test_tensor_details_stats_and_values(fp8_app: Inspector) -> None:
    ck, tensor = fp8_app.ck, fp8_app.tensor
    fp8_app.tree.select(WQ)
    details = text(tensor.details)
    assert "subclass WeightWithDynamicFloat8CastTensor" in details
    assert "fp8 wrapper -> float8_e4m3fn" in details and "global shape 64x64" in details
    for chunk in ck.entry(WQ).chunks:
        assert f"{list(chunk.offsets)} {list(chunk.sizes)} {chunk.file} {chunk.byte_offset}" in (
            details
        )
    assert not tensor.stats_button.disabled and tensor.value_button.disabled
    tensor.stats_button.click()
    tensor.wait()
    expected = ck.stats(WQ)
    stats = text(tensor.stats)
    for name in ("min", "max", "mean", "std", "absmax"):
        assert f"{name} {getattr(expected, name):.6g}" in stats
    assert "nan 0 inf 0" in stats
    assert bytes(tensor.histogram.value[:4]) == b"\x89PNG" and tensor.histogram.layout.display == ""
    fp8_app.tree.select("lr_scheduler.last_epoch")
    assert tensor.stats_button.disabled and not tensor.value_button.disabled
    assert tensor.histogram.layout.display == "none" and tensor.stats.value == ""
    tensor.value_button.click()
    assert text(tensor.stats).split() == ["value", repr(ck.read_object("lr_scheduler.last_epoch"))]
    fp8_app.tree.select("optimizer")
    assert "optimizer" in text(tensor.details) and "315 keys" in text(tensor.details)
    assert tensor.stats_button.disabled and tensor.value_button.disabled


def test_doctor_diagnoses_and_fix_exports(demo_dir: Path, tmp_path: Path) -> None:
    app = Inspector(demo_dir / "prefixed")
    doctor, export = app.doctor, app.export
    doctor.against.value = "inspector.demo.model:build_model"
    doctor.check_button.click()
    result = text(doctor.result)
    assert errors_shown(app) == "" and result.startswith("mismatch Compared the 21 model entries")
    assert (
        "missing from the checkpoint (21)" in result
        and "unexpected in the checkpoint (21)" in result
    )
    assert "1 strip 'model.'" in result and not doctor.apply_button.disabled
    doctor.apply_button.click()
    assert app.tabs.selected_index == TABS.index("Export")
    assert text(export.rename) == "Rename: strip 'model.' (21 keys renamed)"
    export.flatten.value = False
    export.out.value = str(tmp_path / "fixed")
    export.export_button.click()
    export.wait()
    assert "verified 21 tensors bit-exact" in text(export.outcome)
    model = build_model(seed=3)
    model.load_state_dict(load_file(tmp_path / "fixed" / "model.safetensors"), strict=True)
    assert torch.equal(model.output.weight, app.ck.read("model.output.weight"))
    export.clear_rename_button.click()
    assert text(export.rename) == "Rename: none" and export.options.rename is None


def test_doctor_against_a_checkpoint_and_errors(demo_dir: Path, fp8_app: Inspector) -> None:
    doctor = fp8_app.doctor
    doctor.against.value = str(demo_dir / "prefixed")
    doctor.check_button.click()
    assert "1 add 'model.'" in text(doctor.result)
    doctor.against.value = str(demo_dir / "flat")
    doctor.check_button.click()
    assert text(doctor.result).split()[0] == "match" and doctor.apply_button.disabled
    doctor.against.value = ""
    doctor.check_button.click()
    assert "The FQN check failed. nothing to compare with" in text(fp8_app.tab_errors["FQN check"])
    doctor.against.value = str(demo_dir / "missing")
    doctor.check_button.click()
    assert str(demo_dir / "missing") in text(fp8_app.tab_errors["FQN check"])
    assert doctor.result.value == "" and fp8_app.errors.value == ""


def test_export_runs_in_a_thread_with_progress(fp8_app: Inspector, tmp_path: Path) -> None:
    export = fp8_app.export
    assert export.out.value == str(Path("exports") / "fp8")
    statuses = []
    export.status.observe(lambda change: statuses.append(change["new"]), "value")
    export.out.value = str(tmp_path / "bf16")
    export.dtype.value = "bfloat16"
    export.export_button.click()
    export.wait()
    assert export.result is not None and not export.export_button.disabled
    assert export.progress.value == 1.0 and export.progress.bar_style == "success"
    assert statuses[0] == "starting ..." and statuses[-1] == "done"
    assert any(s.startswith("write: 230.0 KB of 230.0 KB") for s in statuses)
    assert any(s.startswith("verify: 230.0 KB of 230.0 KB") for s in statuses)
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert sorted(tensors) == sorted(build_model().state_dict())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    written = tmp_path / "bf16" / "model.safetensors"
    outcome = text(export.outcome)
    assert outcome.startswith("ok verified 21 tensors bit-exact")  # no doubled word
    assert f"{written} {human_bytes(written.stat().st_size)}" in outcome

    export.export_button.click()
    export.wait()
    assert export.progress.bar_style == "danger" and export.status.value == "failed"
    assert "The export failed." in text(export.outcome) and "overwrite" in text(export.outcome)
    assert "The export failed." in text(fp8_app.tab_errors["Export"])
    assert not export.export_button.disabled and fp8_app.errors.value == ""


def test_export_pt_and_bad_settings(fp8_app: Inspector, tmp_path: Path) -> None:
    export = fp8_app.export
    export.max_shard_size.value = "lots"
    export.export_button.click()
    assert "Starting the export failed. max shard size" in text(fp8_app.tab_errors["Export"])
    assert export.thread is None
    export.max_shard_size.value = "5GB"
    export.format.value = "pt"
    export.model_only.value = False
    export.out.value = str(tmp_path / "pt")
    export.export_button.click()
    export.wait()
    saved = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert "train_state.step" in saved and torch.equal(saved[WQ], fp8_app.ck.read(WQ))


def test_export_hugging_face_folder_with_assets(demo_dir: Path, tmp_path: Path) -> None:
    app = Inspector(demo_dir / "llama_hf" / "checkpoint")
    export = app.export
    assert export.hf_assets.layout.display == "none"
    export.format.value = "hf"
    assert export.format.label == "Hugging Face folder"
    assert export.hf_assets.layout.display == "" and export.flatten.layout.display == "none"
    assets = demo_dir / "llama_hf" / "assets"
    export.hf_assets.value = str(assets)
    export.out.value = str(tmp_path / "hf")
    export.export_button.click()
    export.wait()
    shown = text(export.outcome)
    assert "verified 21 tensors bit-exact" in shown and "arch llama3: all 21 model weights" in shown
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        assets / "tokenizer.json"
    ).read_bytes()
    export.format.value = "safetensors"
    assert export.hf_assets.layout.display == "none" and export.flatten.layout.display == ""


def test_export_form_fields_come_from_the_shared_options(fp8_app: Inspector) -> None:
    export = fp8_app.export
    assert export.fp8.tooltip == OPTION["fp8"].help
    assert [mode for _, mode in export.fp8.options] == list(OPTION["fp8"].choices)
    assert (export.fp8.description, export.overwrite.description) == (
        "FP8 handling",
        "Overwrite existing output",
    )
    assert export.max_shard_size.value == OPTION["max_shard_size"].default


def test_fp8_field_only_for_fp8_checkpoints(demo_dir: Path, fp8_app: Inspector) -> None:
    fp8_app.header.wait()
    assert fp8_app.export.fp8.layout.display == ""
    plain = Inspector(demo_dir / "flat")
    plain.header.wait()
    assert plain.export.fp8.layout.display == "none"
    plain.export.preset_fp8("unwrap", "asked for")
    assert plain.export.fp8.layout.display == "" and plain.export.fp8.value == "unwrap"


def test_export_errors_name_the_form_fields(fp8_app: Inspector, tmp_path: Path) -> None:
    export = fp8_app.export
    export.out.value = str(tmp_path / "twice")
    for _ in range(2):
        export.export_button.click()
        export.wait()
    shown = text(export.outcome)
    assert "pass overwrite existing output to replace it" in shown, shown
    assert "overwrite=True" not in shown
    export.workers.value = 1
    export.max_shard_size.value = "0"
    export.export_button.click()
    assert "max shard size: size must be positive" in text(fp8_app.tab_errors["Export"])


def test_arrow_keys_move_open_and_close(fp8_app: Inspector, monkeypatch) -> None:
    tree, keys = fp8_app.tree, fp8_app.tree.tree
    keys.cursor = ["node", "layers"]  # the browser sends lists
    assert keys.cursor == ("node", "layers")
    keys.press("right", keys.cursor)
    assert tree.outline.is_expanded("layers") and keys.cursor == ("node", "layers")
    keys.press("right", keys.cursor)
    assert keys.cursor == ("node", "layers.0") and not tree.outline.is_expanded("layers.0")
    keys.press("left", keys.cursor)
    assert keys.cursor == ("node", "layers") and tree.outline.is_expanded("layers")
    keys.press("left", keys.cursor)
    assert not tree.outline.is_expanded("layers") and shown_prefixes(fp8_app) == top_level(
        fp8_app
    )
    keys.value = ["node", WQ]  # Enter on a row: selected, its details shown, copyable
    assert tree.selected == WQ and keys.cursor == ("node", WQ)
    assert fp8_app.tensor.copy_button.text == WQ and text(fp8_app.tensor.details).startswith(WQ)
    keys.press("left", keys.cursor)
    assert keys.cursor == ("node", "layers.0.attention.wq")
    layer = [k for k in fp8_app.ck.keys() if k.startswith("layers.1.")]
    inner = {".".join(k.split(".")[:i]) for k in layer for i in range(2, k.count(".") + 1)}
    keys.press("expand_below", ("node", "layers.1"))
    assert f"opened {len(inner)} nodes below layers.1" in text(tree.status)
    assert set(layer) <= set(shown_prefixes(fp8_app))
    monkeypatch.setattr("inspector.ui.widgets.tree.EXPAND_BELOW", 2)
    tree.collapse_all_button.click()
    tree.expand_button.click()  # nothing selected: below the root, capped
    assert "opened the first 2 nodes below the root: the rest stay closed" in text(tree.status)
    assert sum(tree.outline.is_expanded(p) for p in shown_prefixes(fp8_app)) == 1
    assert errors_shown(fp8_app) == ""


def test_quantized_weights_are_badged_with_their_scheme(tmp_path: Path) -> None:
    from tests.fixtures import compressed_tensors_folders as ctf

    expected = ctf.write(tmp_path)  # written and decompressed by compressed-tensors itself
    module = "model.layers.0.mlp.down_proj"
    for folder, scheme in (
        ("fp8_channel", "float-quantized float8 channel"),
        ("int8_channel", "naive-quantized int8 channel"),
    ):
        app = Inspector(tmp_path / folder)
        app.header.wait()
        app.tree.select(module)
        labels = {v[1]: label.replace("\xa0", " ") for label, v in app.tree.tree.options}
        assert labels[f"{module}.weight"].endswith(f"[{scheme}]"), labels[f"{module}.weight"]
        assert "[FP8]" not in labels[f"{module}.weight"]
        assert labels[f"{module}.weight_scale"].endswith("B")  # a part: no scheme badge
        entries = text(app.tree.entries)
        assert f"{module}.weight" in entries and scheme in entries  # the entries table too
        export = app.export
        assert export.preset_buttons["dequantize"].layout.display != "none"
        export.preset_buttons["dequantize"].click()
        export.out.value = str(tmp_path / f"{folder}.safetensors")
        export.export_button.click()
        export.wait()
        written = load_file(tmp_path / f"{folder}.safetensors")
        for key, value in expected[folder].items():
            assert torch.equal(written[key], value.to(written[key].dtype)), key


def test_export_presets(demo_dir: Path, fp8_app: Inspector, tmp_path: Path) -> None:
    export = fp8_app.export
    assert export.preset_buttons["dequantize"].layout.display == ""
    export.preset_buttons["dequantize"].click()
    assert (export.format.value, export.fp8.value, export.dtype.value) == (
        "safetensors",
        "dequantize",
        "",
    )
    assert "Dequantize" in text(export.preset)
    app = Inspector(demo_dir / "llama_hf" / "checkpoint")  # plain bf16: nothing to dequantize
    app.header.wait()
    export = app.export
    assert export.preset_buttons["dequantize"].layout.display == "none"
    assert export.preset_buttons["serve_fp8"].layout.display != "none"
    export.preset_buttons["serve_fp8"].click()
    assert (export.format.value, export.fp8.value) == ("hf", "quantize")
    assert export.fp8.layout.display == ""
    config, tensors = _serve(export, demo_dir, tmp_path / "served")
    assert config["quantization_config"]["format"] == "float-quantized"
    q_proj = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{q_proj}.weight_scale"].shape[0] == tensors[f"{q_proj}.weight"].shape[0]


def _serve(export: ExportPanel, demo_dir: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Export the llama_hf demo as the form is set, into ``out`` with its assets; the
    written config and tensors, once the export says it verified them."""
    export.hf_assets.value = str(demo_dir / "llama_hf" / "assets")
    export.out.value = str(out)
    export.export_button.click()
    export.wait()
    assert "verified" in text(export.outcome), text(export.outcome)
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def test_fp8_scheme_field_follows_quantize(demo_dir: Path, tmp_path: Path) -> None:
    app = Inspector(demo_dir / "llama_hf" / "checkpoint")
    app.header.wait()
    export = app.export
    assert export.fp8_scheme.layout.display == "none"  # nothing quantizes yet
    export.preset_buttons["serve_fp8"].click()
    assert export.fp8_scheme.layout.display == ""
    export.fp8_scheme.value = "fine-grained"
    config, tensors = _serve(export, demo_dir, tmp_path / "served")
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.float32
    export.fp8.value = "dequantize"  # the scheme chosen stays out of a dequantizing export
    assert export.fp8_scheme.layout.display == "none"
    assert export._read_form().values["fp8_scheme"] == "channel"
