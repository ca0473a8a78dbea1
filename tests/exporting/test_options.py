"""Export settings from a form: checked, turned into export arguments, renamed by the doctor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.demo.model import build_model
from inspector.errors import InspectorError, output_exists
from inspector.exporting import options as options_module
from inspector.exporting.options import (
    FORM_DEFAULTS,
    FORM_OPTIONS,
    ExportForm,
    app_spelling,
    default_out,
    rewrite_rename,
)
from inspector.exporting.plan import PARALLEL_BYTES, suggested_workers
from inspector.exporting.request import OPTION

MODEL_KEYS = list(build_model().state_dict())


def test_targets_and_defaults(demo_dir: Path, tmp_path: Path) -> None:
    assert ExportForm(out="o").target() == Path("o")
    assert ExportForm(out="o", format="pt").target() == Path("o") / "model.pt"
    assert ExportForm(out="o/w.pth", format="pt").target() == Path("o/w.pth")
    assert ExportForm(out="o/m.safetensors").target() == Path("o/m.safetensors")
    assert default_out(inspector.open(demo_dir / "flat")) == Path("exports") / "flat"
    inspector.export(demo_dir / "seed", tmp_path / "s", progress=False)
    single = inspector.open(tmp_path / "s" / "model.safetensors")
    assert default_out(single, tmp_path) == tmp_path / "model"


def test_arguments_are_checked_before_exporting() -> None:
    arguments = ExportForm(out="o", dtype="float16", fp8="unwrap", flatten=False).arguments()
    assert arguments == {
        "format": "safetensors",
        "dtype": "float16",
        "fp8": "unwrap",
        "fp8_scheme": "channel",
        "model_only": True,
        "flatten": False,
        "rename": None,
        "max_shard_size": "5GB",
        "overwrite": False,
        "verify": True,
    }
    for options, message in (
        (ExportForm(out=" "), "no output folder"),
        (ExportForm(out="o", max_shard_size="5 parsecs"), "max shard size: cannot read size"),
        (ExportForm(out="o", format="npz"), "format must be one of"),
        (ExportForm(out="o", fp8="ignore"), "FP8 handling must be one of"),
        (ExportForm(out="o", dtype="half-ish"), "unknown dtype"),
    ):
        with pytest.raises(InspectorError, match=message):
            options.arguments()


def test_best_rewrite_renames_stored_keys(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    report = inspector.check_keys(ck, build_model())
    options = ExportForm(out=str(tmp_path / "fixed"), flatten=False)
    options.use_rewrite(ck, report)
    assert options.rename == {f"model.{k}": k for k in MODEL_KEYS}
    assert options.rename_source == "strip 'model.' (21 keys renamed)"
    progress = []
    result = options.run(ck, progress.append)
    assert result.verification.ok and progress[-1].phase == "verify"
    model = build_model(seed=1)
    model.load_state_dict(load_file(tmp_path / "fixed" / "model.safetensors"), strict=True)
    assert torch.equal(model.norm.weight, ck.read("model.norm.weight"))
    options.clear_rename()
    assert options.rename is None and options.rename_source is None


def test_rewrite_spelled_flattened_maps_to_stored_keys(dcp_torch_save: dict) -> None:
    ck = inspector.open(dcp_torch_save["prefixed"])
    report = inspector.check_keys(ck, [f"backbone.{k}" for k in MODEL_KEYS])
    assert report.spelling == "flattened" and report.best.description == "add 'backbone.'"
    assert rewrite_rename(ck, report) == {f"model.{k}": f"backbone.{k}" for k in MODEL_KEYS}


def test_nothing_to_apply(demo_dir: Path) -> None:
    flat, seed = inspector.open(demo_dir / "flat"), inspector.open(demo_dir / "seed")
    options = ExportForm(out="o")
    with pytest.raises(InspectorError, match="no rewrite to apply: the keys already match"):
        options.use_rewrite(flat, inspector.check_keys(flat, build_model()))
    prefixed_report = inspector.check_keys(demo_dir / "prefixed", build_model())
    with pytest.raises(InspectorError, match=r"was about .*prefixed, not this checkpoint"):
        options.use_rewrite(seed, prefixed_report)
    assert options.rename is None


def test_hf_folder_arguments() -> None:
    options = ExportForm(out="o", format="hf", hf_assets=" assets ")
    options.rename = {"a": "b"}
    assert options.target() == Path("o")
    assert options.arguments() == {
        "format": "hf",
        "dtype": None,
        "fp8": "dequantize",
        "fp8_scheme": "channel",
        "max_shard_size": "5GB",
        "overwrite": False,
        "verify": True,
        "arch": "auto",
        "hf_assets": "assets",
        "hf_config": None,
    }
    assert ExportForm(out="o", format="hf", hf_assets="").arguments()["hf_assets"] is None


def test_workers_above_one_are_passed_on() -> None:
    assert "workers" not in ExportForm(out="o").arguments()  # one process: the default
    assert ExportForm(out="o", workers=4).arguments()["workers"] == 4
    with pytest.raises(InspectorError, match="workers must be at least 1"):
        ExportForm(out="o", workers=0).arguments()
    assert "workers" not in ExportForm(out="o", format="hf", workers=4).arguments()


def test_workers_are_suggested_for_large_exports() -> None:
    assert suggested_workers(PARALLEL_BYTES - 1, cpus=16) == 1
    assert suggested_workers(PARALLEL_BYTES, cpus=2) == 2
    assert suggested_workers(1 << 40, cpus=64) == 8
    assert suggested_workers(1 << 40, cpus=1) == 1


def test_two_workers_from_the_options_write_what_one_does(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    one = ExportForm(out=str(tmp_path / "one"), dtype="bfloat16").run(ck)
    two = ExportForm(out=str(tmp_path / "two"), dtype="bfloat16", workers=2).run(ck)
    assert one.verification.ok and two.verification.ok
    assert (tmp_path / "one/model.safetensors").read_bytes() == (
        tmp_path / "two/model.safetensors"
    ).read_bytes()


def test_url_targets_stay_urls() -> None:
    url = ExportForm(out="s3://bucket/out/")
    assert url.target() == "s3://bucket/out"
    assert url.arguments()["format"] == "safetensors"
    assert ExportForm(out="s3://b/x", format="pt").target() == "s3://b/x/model.pt"


def test_hf_settings_and_arch_auto(demo_dir: Path, tmp_path: Path) -> None:
    arguments = ExportForm(
        out="o", format="hf", arch="llama3", hf_assets=" a/ ", hf_config="c.json"
    ).arguments()
    assert (arguments["arch"], arguments["hf_assets"], arguments["hf_config"]) == (
        "llama3",
        "a/",
        "c.json",
    )
    assert ExportForm(out="o", format="hf").arguments()["hf_config"] is None
    ok, why = options_module.arch_auto(inspector.open(demo_dir / "llama_hf" / "checkpoint"))
    assert ok and why.startswith("llama3: all 21 model weights match its rules in torchtitan 0.3")
    ok, why = options_module.arch_auto(inspector.open(demo_dir / "fp8"), "unwrap")
    assert ok and why.startswith("llama3: all 21 model weights") and "July-2025 names" in why
    llama = demo_dir / "llama_hf"
    inspector.export(
        llama / "checkpoint", tmp_path / "hf", "hf", hf_assets=llama / "assets", progress=False
    )
    ok, why = options_module.arch_auto(inspector.open(tmp_path / "hf"))
    assert ok and why.startswith("llama3: all 21 model weights match its rules in HF names")
    assert why.endswith(": names kept")


def test_form_defaults_are_the_export_options_defaults() -> None:
    form = ExportForm(out="o")
    assert list(form.values) == list(FORM_OPTIONS)
    assert {k: v for k, v in form.values.items() if k not in FORM_DEFAULTS} == {
        name: OPTION[name].default for name in FORM_OPTIONS if name not in FORM_DEFAULTS
    }
    with pytest.raises(InspectorError, match="the export form has no naming"):
        ExportForm(out="o", naming="torchtitan")


def test_front_ends_spell_the_option_an_error_names(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("there")
    error = output_exists(tmp_path / "out")
    assert str(error).endswith("already exists; pass overwrite=True to replace it")
    assert error.worded(app_spelling).endswith("pass overwrite existing output to replace it")
    assert error.worded(lambda name: OPTION[name].flag).endswith("pass --overwrite to replace it")
