"""The FQN doctor: why a checkpoint's keys do not match a model, and the rename that fixes it.

The checkpoint's model entries are compared in one spelling (see ``SPELLINGS``) with the
keys a model, state dict, key list or other checkpoint has; mismatches are explained by
ranked rewrites (:mod:`inspector.keys.rewrites`). Comparing with key lists or checkpoints
needs no torch.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.errors import InspectorError
from inspector.keys.rewrites import Spec, Suggestion, suggest
from inspector.keys.spellings import VIEWS, view_key

if TYPE_CHECKING:
    import pandas

SPELLINGS = {
    "stored": "as stored (the keys dcp.load matches)",
    "flattened": "without their component prefix (what load_state_dict(sd['model']) sees)",
    "prefixed": "under 'model.' (the model's state dict nested under 'model')",
}
_EXAMPLES = 3
_ALL_MATCH = {
    False: "Every key, shape and dtype matches.",
    True: "Every key the error names matches.",
}
TABLE_COLUMNS = (
    "checkpoint_key",
    "model_key",
    "status",
    "checkpoint_shape",
    "model_shape",
    "checkpoint_dtype",
    "model_dtype",
    "rewritten_key",
    "status_after",
)


@dataclass(frozen=True)
class KeyMismatch:
    """A matched key whose shape (or dtype) differs between checkpoint and model."""

    checkpoint_key: str
    model_key: str
    checkpoint: Any
    model: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_key": self.checkpoint_key,
            "model_key": self.model_key,
            "checkpoint": _jsonable(self.checkpoint),
            "model": _jsonable(self.model),
        }


@dataclass(repr=False)
class KeyReport:
    """Checkpoint keys vs model keys: matched, missing, unexpected, shape and dtype mismatches.

    ``ours`` / ``theirs`` map checkpoint / model keys to (shape, dtype name), either None
    when unknown; ``pairs`` maps each matched checkpoint key to its model key. ``missing``
    are model keys the checkpoint lacks, ``unexpected`` checkpoint keys the model lacks.
    ``partial`` means only some of the model's keys are known (a DCP error names the
    first missing one), so nothing counts as unexpected. ``rewrite`` is the rename applied
    to the checkpoint keys before comparing (None: as spelled).
    """

    checkpoint: str
    against: str
    spelling: str
    ours: dict[str, Spec]
    theirs: dict[str, Spec]
    partial: bool = False
    rewrite: Suggestion | None = None
    pairs: dict[str, str] = field(init=False)
    missing: list[str] = field(init=False)
    unexpected: list[str] = field(init=False)
    shape_mismatches: list[KeyMismatch] = field(init=False)
    dtype_mismatches: list[KeyMismatch] = field(init=False)

    def __post_init__(self) -> None:
        rename = self.rewrite.apply if self.rewrite else str
        self.pairs, self.unexpected = {}, []
        covered: set[str] = set()
        for key in self.ours:
            target = rename(key)
            if target in self.theirs and target not in covered:
                covered.add(target)
                self.pairs[key] = target
            elif not self.partial:
                self.unexpected.append(key)
        self.missing = [k for k in self.theirs if k not in covered]
        self.shape_mismatches = self._differing(0)
        self.dtype_mismatches = self._differing(1)

    def _differing(self, field_index: int) -> list[KeyMismatch]:
        found = []
        for ours, theirs in self.pairs.items():
            a, b = self.ours[ours][field_index], self.theirs[theirs][field_index]
            if a is not None and b is not None and a != b:
                found.append(KeyMismatch(ours, theirs, a, b))
        return found

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        best = f"; best rewrite: {self.best.description}" if self.best else ""
        return (
            f"<KeyReport {'ok' if self.ok else 'mismatch'} ({self.spelling} spelling): "
            f"{len(self.pairs)} matched, {len(self.missing)} missing, "
            f"{len(self.unexpected)} unexpected, {len(self.shape_mismatches)} shape and "
            f"{len(self.dtype_mismatches)} dtype mismatches{best}>"
        )

    # --- verdicts ---------------------------------------------------------------------------
    @property
    def matched(self) -> list[str]:
        """Model keys the checkpoint provides."""
        return list(self.pairs.values())

    @property
    def loadable(self) -> bool:
        """No missing, unexpected or shape-mismatched key (dtypes are cast on load)."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    @property
    def ok(self) -> bool:
        """Everything matches: keys, shapes and dtypes."""
        return self.loadable and not self.dtype_mismatches

    @cached_property
    def suggestions(self) -> list[Suggestion]:
        """Candidate rewrites of the checkpoint keys, most mismatches resolved first."""
        if self.rewrite is not None:
            return []
        return suggest(self.ours, self.theirs, count_unexpected=not self.partial)

    @property
    def best(self) -> Suggestion | None:
        return self.suggestions[0] if self.suggestions else None

    def mapping(self) -> dict[str, str]:
        """Checkpoint key -> model key after the best rewrite (identity when none helps)."""
        rename = self.best.apply if self.best else str
        return {key: rename(key) for key in self.ours}

    def after(self) -> KeyReport:
        """The same comparison after the best rewrite (this report when no rewrite helps)."""
        if self.best is None:
            return self
        return KeyReport(
            self.checkpoint,
            self.against,
            self.spelling,
            self.ours,
            self.theirs,
            partial=self.partial,
            rewrite=self.best,
        )

    # --- presentation -----------------------------------------------------------------------
    def status(self, checkpoint_key: str) -> str:
        """matched / unexpected / shape mismatch / dtype mismatch for one checkpoint key
        (``unknown`` when unmatched and the model is known only in part)."""
        target = self.pairs.get(checkpoint_key)
        if target is None:
            return "unknown" if self.partial else "unexpected"
        (shape, dtype), (their_shape, their_dtype) = self.ours[checkpoint_key], self.theirs[target]
        if None not in (shape, their_shape) and shape != their_shape:
            return "shape mismatch"
        if None not in (dtype, their_dtype) and dtype != their_dtype:
            return "dtype mismatch"
        return "matched"

    def table(self) -> pandas.DataFrame:
        """One row per checkpoint key and per missing model key (see TABLE_COLUMNS)."""
        import pandas

        after = self.after()
        covered_after = set(after.pairs.values())
        rename = self.best.apply if self.best else str
        rows: list[tuple[Any, ...]] = []
        for key, (shape, dtype) in self.ours.items():
            target = self.pairs.get(key)
            their_shape, their_dtype = self.theirs[target] if target is not None else (None, None)
            status = self.status(key)
            row = (key, target, status, shape, their_shape, dtype, their_dtype)
            rows.append((*row, rename(key), after.status(key)))
        for key in self.missing:
            shape, dtype = self.theirs[key]
            status_after = "matched" if key in covered_after else "missing"
            rows.append((None, key, "missing", None, shape, None, dtype, None, status_after))
        return pandas.DataFrame.from_records(rows, columns=list(TABLE_COLUMNS))

    def explain(self) -> str:
        """A short paragraph: what was compared, what differs, and the rewrite that fixes it."""
        lines = [
            f"Compared the {len(self.ours)} model entries of {self.checkpoint}, spelled "
            f"{SPELLINGS[self.spelling]}, with {_n(len(self.theirs), 'key')} of {self.against}."
        ]
        if self.ok:
            return f"{lines[0]} {_ALL_MATCH[self.partial]}"
        lines.append(self._counts())
        best = self.best
        if best is not None:
            total = best.resolves + best.remaining
            why = f" ({best.why})" if best.why else ""
            lines.append(
                f"Best rewrite: {best.description}{why}; it resolves {best.resolves} of "
                f"{_n(total, 'key mismatch')}."
            )
            lines.append(self.after()._residue())
        else:
            if self.missing or self.unexpected:
                lines.append(
                    "No prefix, wrapper or naming-generation rewrite explains the difference."
                )
            lines.append(self._residue())
        return " ".join(line for line in lines if line)

    def _counts(self) -> str:
        parts = [f"{len(self.pairs)} match"]
        if self.missing:
            parts.append(f"{len(self.missing)} missing from the checkpoint{_eg(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected in it{_eg(self.unexpected)}")
        return ", ".join(parts) + "."

    def _residue(self) -> str:
        """What is left after a rewrite: genuine differences no rename fixes."""
        if self.ok:
            return f"After it: {_ALL_MATCH[self.partial].lower()}"
        parts = []
        if self.rewrite and (self.missing or self.unexpected):
            parts.append(
                f"{len(self.missing)} missing{_eg(self.missing)} and "
                f"{len(self.unexpected)} unexpected{_eg(self.unexpected)} keys remain"
            )
        for name, found in (("shape", self.shape_mismatches), ("dtype", self.dtype_mismatches)):
            if found:
                m = found[0]
                parts.append(
                    f"{_n(len(found), f'{name} mismatch')} ({m.model_key!r}: "
                    f"{_show(m.checkpoint)} in the checkpoint, "
                    f"{_show(m.model)} in the model)"
                )
        if not parts:
            return ""
        prefix = "After it, " if self.rewrite else ""
        notes = [
            " Shapes differ for real: no rename fixes that." if self.shape_mismatches else "",
            " load_state_dict casts dtypes as it copies." if self.dtype_mismatches else "",
        ]
        return f"{prefix}{'; '.join(parts)}.{''.join(notes)}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready report (the ``ckpt-inspect check --json`` shape)."""
        after = self.after()
        return {
            "checkpoint": self.checkpoint,
            "against": self.against,
            "spelling": self.spelling,
            "partial": self.partial,
            "ok": self.ok,
            "loadable": self.loadable,
            "counts": self._count_dict(),
            "missing": self.missing,
            "unexpected": self.unexpected,
            "shape_mismatches": [m.as_dict() for m in self.shape_mismatches],
            "dtype_mismatches": [m.as_dict() for m in self.dtype_mismatches],
            "suggestions": [s.as_dict() for s in self.suggestions],
            "after_best": {
                "ok": after.ok,
                "counts": after._count_dict(),
                "renamed": {k: v for k, v in self.mapping().items() if k != v},
                "shape_mismatches": [m.as_dict() for m in after.shape_mismatches],
                "dtype_mismatches": [m.as_dict() for m in after.dtype_mismatches],
            }
            if self.best
            else None,
            "explanation": self.explain(),
        }

    def _count_dict(self) -> dict[str, int]:
        return {
            "checkpoint": len(self.ours),
            "model": len(self.theirs),
            "matched": len(self.pairs),
            "missing": len(self.missing),
            "unexpected": len(self.unexpected),
            "shape_mismatches": len(self.shape_mismatches),
            "dtype_mismatches": len(self.dtype_mismatches),
        }


# --- check_keys ---------------------------------------------------------------------------
def check_keys(
    ck: Checkpoint | str | os.PathLike,
    against: Any,
    *,
    spelling: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> KeyReport:
    """Compare a checkpoint's model keys with ``against`` and suggest the rename that fixes them.

    ``against``: an ``nn.Module`` (its ``state_dict()``; meta-device models work), a state
    dict (tensors or shapes, nested dicts joined with dots), a list of keys, a Checkpoint or
    a checkpoint path. ``spelling`` (stored / flattened / prefixed) defaults to ``stored``
    for DCP, whose loader matches stored keys, and ``flattened`` for other formats.
    ``storage_options``: fsspec options for checkpoints given as URLs.
    """
    ck = as_checkpoint(ck, storage_options)
    spelling = spelling or default_spelling(ck)
    theirs, description = _target(against, storage_options)
    return KeyReport(ck.location, description, spelling, model_specs(ck, spelling), theirs)


def default_spelling(ck: Checkpoint) -> str:
    """The spelling the checkpoint's own loader matches (stored keys for DCP's)."""
    return ck.source.key_matching


def model_specs(ck: Checkpoint, spelling: str) -> dict[str, Spec]:
    """The checkpoint's model entries: key in ``spelling`` -> (shape, dtype name)."""
    if spelling not in VIEWS:
        raise ValueError(f"spelling must be one of {VIEWS}, not {spelling!r}")
    return {
        view_key(e, spelling): (e.shape if e.kind == "tensor" else None, e.dtype)
        for e in ck.entries()
        if e.component == "model"
    }


def _target(
    against: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[dict[str, Spec], str]:
    if isinstance(against, (Checkpoint, str, os.PathLike)):
        other = as_checkpoint(against, storage_options)
        spelling = default_spelling(other)
        return model_specs(other, spelling), f"the model entries of {other.location} ({spelling})"
    if _is_module(against):
        specs = _flatten(against.state_dict())
        return specs, f"nn.Module {type(against).__name__} (state_dict keys)"
    if isinstance(against, Mapping):
        return _flatten(against), "the given state dict"
    if isinstance(against, Iterable):
        keys = list(against)
        if all(isinstance(k, str) for k in keys):
            return dict.fromkeys(keys, (None, None)), "the given key list"
    raise TypeError(
        "against must be an nn.Module, a state dict, a list of keys, a Checkpoint or a path, "
        f"not {type(against).__name__}"
    )


def _flatten(state: Mapping, prefix: str = "") -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = _spec(value)
    return out


def _is_module(value: Any) -> bool:
    """An ``nn.Module`` (if torch was never imported, nothing can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _spec(value: Any) -> Spec:
    if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "stride"):
        return tuple(value.shape), str(value.dtype).removeprefix("torch.")
    if isinstance(value, (tuple, list)) and all(isinstance(n, int) for n in value):
        return tuple(value), None
    return None, None


def model_from_factory(spec: str, device: str = "meta") -> Any:
    """Import ``module.path:factory`` and call it (under ``device``) to build the model."""
    module_name, _, attr = spec.partition(":")
    try:
        factory: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise InspectorError(f"cannot import {spec!r} ({exc})") from exc
    import torch

    with torch.device(device):
        return factory()


def is_factory_spec(text: str) -> bool:
    """Whether ``text`` reads as ``module.path:factory`` rather than a path."""
    return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", text) is not None


def resolve_against(text: str, device: str = "meta") -> Any:
    """What a typed "compare with" names: the model a ``module.path:factory`` builds (under
    ``device``), else a checkpoint path (an existing path wins over a factory reading)."""
    text = text.strip()
    if not text:
        raise InspectorError("nothing to compare with: give a checkpoint path or module:factory")
    if is_factory_spec(text) and not Path(text).exists():
        return model_from_factory(text, device)
    return Path(text).expanduser()


# --- helpers ------------------------------------------------------------------------------
def _n(count: int, noun: str) -> str:
    plural = "es" if noun.endswith(("s", "sh", "ch")) else "s"
    return f"{count} {noun}{'' if count == 1 else plural}"


def _eg(keys: list[str]) -> str:
    return f" (e.g. {', '.join(map(repr, keys[:_EXAMPLES]))})" if keys else ""


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
