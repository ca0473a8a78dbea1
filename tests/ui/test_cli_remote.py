"""``ckpt-inspect`` on remote checkpoints: ``--storage-option KEY=VALUE`` on every
sub-command (``--target-option`` for an export's URL), against moto's S3 on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.ui.cli import main, parse_option
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded

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


def test_every_subcommand_takes_storage_options(
    s3_server: CountedServer, demo_dir: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``main`` (what the console script runs) in this process, with the server's endpoint
    taken out of the environment: the options given are the only way to reach it."""
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    given = options(s3_server)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = run("ls", url, "--json", "--no-scan", *given)
    assert code == 0 and json.loads(out)["path"] == url, err
    code, out, err = run("show", url, WQ, *given)
    assert code == 0 and "shape    [64, 64]" in out, err
    code, out, err = run("diff", url, str(demo_dir / "fp8"), "--json", *given)
    assert code == 0 and json.loads(out)["equal"], err
    code, out, err = run("check", url, "--against", str(demo_dir / "fp8"), *given)
    assert code == 0, err
    target = s3_server.address("remote-tests/cli-export")
    code, out, err = run("export", url, target, "--no-verify", *given,
                         *options(s3_server, "--target-option"))
    assert code == 0 and f"{target}/model.safetensors" in out, err
    code, out, err = run("ls", url + "-missing", *given)
    assert code == 2 and "no such file or folder" in err
