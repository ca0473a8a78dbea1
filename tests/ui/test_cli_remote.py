"""``ckpt-inspect`` on remote checkpoints: ``--storage-option KEY=VALUE`` on every
sub-command (``--target-option`` for an export's URL), against moto's S3 on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.ui.cli import main, parse_option
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded
from tests.ui.test_cli import cli

WQ = "layers.0.attention.wq.weight"


def options(server: CountedServer, flag: str = "--storage-option") -> list[str]:
    return [arg for k, v in server.storage_options.items() for arg in (flag, f"{k}={v}")]


def test_option_values_are_json_or_text() -> None:
    assert parse_option("anon=true") == ("anon", True)
    assert parse_option('client_kwargs={"region_name": "eu"}') == ("client_kwargs",
                                                                    {"region_name": "eu"})
    assert parse_option("endpoint_url=http://127.0.0.1:9/x=y") == ("endpoint_url",
                                                                    "http://127.0.0.1:9/x=y")
    with pytest.raises(SystemExit):
        main(["ls", "s3://b/x", "--storage-option", "novalue"])


def test_every_subcommand_takes_storage_options(s3_server: CountedServer, demo_dir: Path,
                                                tmp_path: Path) -> None:
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    ls = cli("ls", url, "--json", "--no-scan", *options(s3_server))
    assert ls.returncode == 0, ls.stderr
    assert json.loads(ls.stdout)["path"] == url
    show = cli("show", url, WQ, *options(s3_server))
    assert show.returncode == 0 and "shape    [64, 64]" in show.stdout, show.stderr
    diff = cli("diff", url, str(demo_dir / "fp8"), "--json", *options(s3_server))
    assert diff.returncode == 0 and json.loads(diff.stdout)["equal"], diff.stderr
    check = cli("check", url, "--against", str(demo_dir / "fp8"), *options(s3_server))
    assert check.returncode == 0, check.stderr
    target = s3_server.address("remote-tests/cli-export")
    export = cli("export", url, target, "--no-verify", *options(s3_server),
                 *options(s3_server, "--target-option"))
    assert export.returncode == 0, export.stderr
    assert f"{target}/model.safetensors" in export.stdout
    missing = cli("ls", url + "-missing", *options(s3_server))
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
