"""Diagnosing a pasted load error: torch's ``load_state_dict`` RuntimeError or DCP's
"Missing key in checkpoint state_dict" / size mismatch, against the checkpoint."""

from __future__ import annotations

import os
import re

from inspector.analysis.fqn import KeyReport, default_spelling, model_specs
from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.errors import InspectorError
from inspector.keys.rewrites import Spec
from inspector.keys.spellings import VIEWS

_TORCH_HEADER = re.compile(r"Error\(s\) in loading state_dict for (\w+)")
_TORCH_LIST = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: ([^\n]*)")
_SIZE = r"torch\.Size\(\[([\d, ]*)\]\)"
_TORCH_SIZE = re.compile(
    rf"size mismatch for (\S+): copying a param with shape {_SIZE} from checkpoint, "
    rf"the shape in current model is {_SIZE}"
)
# (?<!") skips the raise statements a pasted traceback quotes from torch's source.
_KEY = r"([^\s\"'{}]+)"
_DCP_MISSING = re.compile(rf'(?<!")Missing key(?: in checkpoint state_dict)?: {_KEY}')
_DCP_SIZE = re.compile(rf"Size mismatch between saved {_SIZE} and current: {_SIZE} for {_KEY}")


def explain_error(
    ck: Checkpoint | str | os.PathLike, text: str, *, spelling: str | None = None
) -> KeyReport:
    """Diagnose a pasted ``load_state_dict`` RuntimeError or DCP missing-key/size error.

    The report compares the checkpoint with the keys the error says the model wanted.
    """
    ck = as_checkpoint(ck)
    if _TORCH_HEADER.search(text) or _TORCH_LIST.search(text) or _TORCH_SIZE.search(text):
        return _from_torch_error(ck, text, spelling)
    missing = [m.rstrip(".") for m in _DCP_MISSING.findall(text)]
    sizes = {key: _shape(cur) for _, cur, key in _DCP_SIZE.findall(text)}
    if not missing and not sizes:
        raise InspectorError(
            "no load_state_dict or DCP key error found in the text", file=ck.location
        )
    theirs: dict[str, Spec] = dict.fromkeys(missing, (None, None))
    theirs |= {k: (s, None) for k, s in sizes.items()}
    return KeyReport(
        ck.location,
        f"the model of a DCP load error ({len(missing)} missing, {len(sizes)} size mismatch; "
        "DCP stops at the first problem, so the model is known only in part)",
        spelling or "stored",
        model_specs(ck, spelling or "stored"),
        theirs,
        partial=True,
    )


def _from_torch_error(ck: Checkpoint, text: str, spelling: str | None) -> KeyReport:
    listed: dict[str, list[str]] = {"Missing": [], "Unexpected": []}
    for kind, keys in _TORCH_LIST.findall(text):
        listed[kind] += re.findall(r'"([^"]*)"', keys)
    sizes = {key: _shape(model) for key, _, model in _TORCH_SIZE.findall(text)}
    missing, unexpected = listed["Missing"], set(listed["Unexpected"])
    spelling = spelling or _spelling_for(ck, missing, unexpected | sizes.keys())
    ours = model_specs(ck, spelling)
    theirs: dict[str, Spec] = {
        k: (sizes.get(k, shape), None) for k, (shape, _) in ours.items() if k not in unexpected
    }
    theirs.update(dict.fromkeys((k for k in missing if k not in theirs), (None, None)))
    header = _TORCH_HEADER.search(text)
    module = header.group(1) if header else "a module"
    return KeyReport(
        ck.location,
        f"{module} as its load_state_dict error describes it ({len(missing)} missing, "
        f"{len(unexpected)} unexpected, {len(sizes)} size mismatch)",
        spelling,
        ours,
        theirs,
    )


def _spelling_for(ck: Checkpoint, missing: list[str], present: set[str]) -> str:
    """The spelling that best agrees with the error: keys it saw present, missing ones absent."""
    default = default_spelling(ck)

    def agreement(spelling: str) -> int:
        keys = model_specs(ck, spelling)
        return len(present & keys.keys()) + sum(k not in keys for k in missing)

    return max((default, *(v for v in VIEWS if v != default)), key=agreement)


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n.strip())
