"""Class 1, text that reaches a terminal: key names, metadata strings and object values that
carry terminal escape sequences (window title, OSC 52 clipboard, CSI), carriage returns,
bidi overrides, NUL, C1 controls and lone surrogates, saved by torch.save and
safetensors, then shown by every CLI command. No such character may reach stdout or stderr
raw; ``--json`` stays exact JSON that reads back as the saved keys."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase

PAYLOADS = {
    "title": "\x1b]0;owned\x07",
    "clipboard": "\x1b]52;c;Y3VybCBldmlsLnNo\x07",
    "csi": "\x1b[2J\x1b[31m",
    "carriage-return": "\rsafe.weight",
    "bidi": "\u202egnp.\u2066x\u2069",
    "nul": "a\x00b",
    "c1": "\x9b31m\x9d0;t\x9c\x85",
    "surrogate": "w\ud800x\udfff",
    "line-separator": "a\u2028b\u2029c",
}
# Independent of the code under test: what acts on a terminal or cannot be encoded.
ACTIVE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _cli(args: list[str]) -> tuple[int, str, str]:
    """``ckpt-inspect args`` in this process: exit status, stdout, stderr."""
    from inspector.ui.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def _saved(payload: str, folder: Path, storage: str) -> tuple[Path, dict[str, Any]]:
    """A checkpoint whose key names, metadata and object values carry ``payload``."""
    import torch

    keys = {
        f"model.{payload}.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        f"{payload}": torch.ones(3, dtype=torch.bfloat16),
        "plain.weight": torch.zeros(4),
    }
    if storage == "safetensors":
        from safetensors.torch import save_file

        path = folder / "hostile.safetensors"
        save_file(keys, str(path), metadata={payload: payload, "format": "pt"})
        return path, keys
    path = folder / "hostile.pt"
    torch.save({**keys, f"note{payload}": {payload: [payload, 3]}}, path)
    return path, keys


def run(args: dict[str, Any], report: Report) -> None:
    tmp = Path(args["tmp"])
    payload = PAYLOADS[args["payload"]]
    path, keys = _saved(payload, tmp, args["storage"])
    twin = tmp / "twin"
    twin.mkdir()
    other, _ = _saved(payload, twin, args["storage"])
    weird = next(k for k in keys if k.startswith("model."))
    commands = [
        ["ls", str(path)],
        ["show", str(path), weird],
        ["show", str(path), f"missing{payload}"],  # an error naming the key, on stderr
        ["diff", str(path), str(other)],
        ["audit", str(path)],
        ["fingerprint", str(path)],
        ["check", str(path), "--against", str(other)],
    ]
    if args["storage"] == "pt":
        commands.append(["export", str(path), str(tmp / "out.pt"), "--format", "pt"])
    for command in commands:
        code, out, err = _cli(command)
        report({"command": command[0], "code": code})
        raw = ACTIVE.search(out + err)
        assert raw is None, f"{command[0]}: {raw.group()!r} reached the terminal: {out + err!r}"
        assert command[0] != "show" or code == (2 if "missing" in command[2] else 0), code
        assert code != 2 or "error:" in err, (command[0], err)
    code, out, _ = _cli(["ls", str(path), "--json"])
    listed = {row["key"] for row in json.loads(out)["entries"]}
    assert code == 0 and set(keys) <= listed, listed
    code, out, _ = _cli(["fingerprint", str(path), "--json"])
    printed = {t["key"] for t in json.loads(out)["tensors"].values()}
    assert code == 0 and printed and printed <= set(keys), printed


def _cases() -> dict[str, TrustCase]:
    found = {}
    for name in PAYLOADS:
        for storage in ("pt", "safetensors"):
            if storage == "safetensors" and "surrogate" in name:
                continue  # safetensors keys are Rust strings: no lone surrogate can be saved
            args = {"payload": name, "storage": storage}
            found[f"terminal:{name}@{storage}"] = TrustCase("tests.hostile.terminal:run", args)
    return found


CASES = _cases()
