"""Files an HF export reads from an untrusted ``hf_assets`` folder or config: only regular
files inside the folder are copied, anything else is refused by name; a config whose
sizes are zero, negative, absurd or not numbers is an ExportError."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import inspector
from inspector.errors import ExportError

# name -> how the planted entry ``special_tokens_map.json`` is made in the assets copy
PLANTS = {
    "link-to-etc-passwd": lambda p: p.symlink_to("/etc/passwd"),
    "link-to-proc-environ": lambda p: p.symlink_to("/proc/self/environ"),
    "link-to-proc-mem": lambda p: p.symlink_to("/proc/self/mem"),
    "link-outside-relative": lambda p: p.symlink_to("../secret.txt"),
    "fifo": lambda p: os.mkfifo(p),
    "link-to-dev-zero": lambda p: p.symlink_to("/dev/zero"),
    "dangling-link": lambda p: p.symlink_to("missing.json"),
}


def _assets(torchtitan_models, tmp_path: Path) -> Path:
    assets = tmp_path / "assets"
    shutil.copytree(torchtitan_models.assets("llama3"), assets)
    (tmp_path / "secret.txt").write_text("not for the export")
    return assets


def _export(torchtitan_models, out: Path, **options) -> inspector.ExportResult:
    return inspector.export(torchtitan_models.dcp("llama3", "torchtitan", "flat"), out,
                            format="hf", progress=False, **options)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_an_asset_that_is_no_regular_file_inside_is_refused(
    torchtitan_models, tmp_path: Path, plant: str
) -> None:
    assets = _assets(torchtitan_models, tmp_path)
    PLANTS[plant](assets / "special_tokens_map.json")
    with pytest.raises(ExportError, match=r"special_tokens_map\.json: .*hf_assets entry"):
        _export(torchtitan_models, tmp_path / "out", hf_assets=assets)
    assert not (tmp_path / "out").exists()


def test_a_link_inside_the_assets_is_copied_under_its_name(torchtitan_models, tmp_path) -> None:
    assets = _assets(torchtitan_models, tmp_path)
    (assets / "tokenizer_alias.json").symlink_to("tokenizer.json")
    result = _export(torchtitan_models, tmp_path / "out", hf_assets=assets)
    copied = tmp_path / "out" / "tokenizer_alias.json"
    assert copied in result.files and not copied.is_symlink()
    assert copied.read_bytes() == (assets / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("plant", ["link-to-proc-environ", "fifo", "link-to-dev-zero"])
def test_a_config_that_is_no_regular_file_is_refused(
    torchtitan_models, tmp_path: Path, plant: str
) -> None:
    config = tmp_path / "config.json"
    PLANTS[plant](config)
    with pytest.raises(ExportError, match=r"config\.json: hf_config is .*not a regular file"):
        _export(torchtitan_models, tmp_path / "out", hf_config=config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_attention_heads", 0),
        ("num_key_value_heads", 0),
        ("head_dim", 0),
        ("num_attention_heads", -8),
        ("hidden_size", -64),
        ("num_hidden_layers", 1 << 62),
        ("num_attention_heads", 2.5),
        ("num_attention_heads", "4"),
        ("num_attention_heads", True),
    ],
)
def test_a_config_with_absurd_sizes_is_an_export_error(
    torchtitan_models, tmp_path: Path, field: str, value: object
) -> None:
    config = torchtitan_models.config("llama3") | {field: value}
    with pytest.raises(ExportError, match=rf"hf_config {field}={value!r} is not a whole number"):
        _export(torchtitan_models, tmp_path / "out", hf_config=config)
    with pytest.raises(ExportError, match=rf"hf_config {field}="):
        inspector.export(torchtitan_models.hf("llama3"), tmp_path / "dcp", format="dcp",
                         hf_config=config, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "dcp").exists()
