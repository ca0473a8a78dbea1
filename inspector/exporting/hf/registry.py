"""The known architectures, lookup by name, and ``arch="auto"``: which one the key names
are, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ExportError
from inspector.exporting.hf import deepseek_v3, llama3, megatron_gpt, qwen3, qwen3_moe
from inspector.exporting.hf.base import (
    NAMINGS,
    Architecture,
    Plan,
    layouts,
    model_keys,
    plan_identity,
    unmatched,
)
from inspector.exporting.hf.names import abstract, template_form

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (llama3.ARCH, qwen3.ARCH, qwen3_moe.ARCH, deepseek_v3.ARCH)
}


def get(name: str) -> Architecture:
    """The architecture called ``name``; an error lists the known ones."""
    if name not in ARCHITECTURES:
        known = ", ".join((*ARCHITECTURES, megatron_gpt.ARCH))
        raise ExportError(f"unknown arch {name!r}; known: auto, {known}")
    return ARCHITECTURES[name]


@dataclass(frozen=True)
class Detection:
    """``arch`` and the side its names are on: ``naming`` is a torchtitan generation, or
    ``"hf"`` for Hugging Face names; ``reason`` says why, and why not the others."""

    arch: Architecture
    naming: str
    reason: str


@dataclass(frozen=True)
class _Fit:
    arch: Architecture
    naming: str
    keys: dict[str, str]
    misses: list[str]
    absent: list[str]


def detect(keys: Iterable[str]) -> Detection:
    """Which architecture (and naming) every model key of a checkpoint belongs to."""
    model, _ = model_keys(dict.fromkeys(keys))
    fits = [
        _fit(arch, naming, mapping)
        for arch in ARCHITECTURES.values()
        for naming in ("hf", *NAMINGS)
        for mapping in (layouts(model) if naming != "hf" else [{k: k for k in model}])
    ]
    good = [f for f in fits if not f.misses and not f.absent]
    if not good:
        best = {}
        for f in sorted(fits, key=lambda f: len(f.misses) + len(f.absent), reverse=True):
            best[f.arch.name] = f
        why = "; ".join(_why_not(f) for f in best.values())
        raise ExportError(f"no known architecture fits these keys ({why}): pass arch=")
    if len({f.arch.name for f in good}) > 1:
        names = ", ".join(sorted({f.arch.name for f in good}))
        raise ExportError(f"several architectures fit these keys ({names}): pass arch=")
    # Keys that read the same in both generations: the first naming (0.3) is as good as any.
    win = good[0]
    side = "HF names" if win.naming == "hf" else NAMINGS[win.naming]
    prefix = " under the legacy model. prefix" if any(k != v for k, v in win.keys.items()) else ""
    reason = f"{win.arch.name}: all {len(win.keys)} model weights match its rules in {side}{prefix}"
    if win.arch.markers:
        reason += " and they include " + ", ".join(repr(_example(win, m)) for m in win.arch.markers)
    others = [
        _why_not(f)
        for f in fits
        if f.arch is not win.arch and f.naming == win.naming and f.keys == win.keys
    ]
    if others:
        reason += " (not " + "; not ".join(others) + ")"
    return Detection(win.arch, win.naming, reason)


def auto_reason(tensors: Mapping[str, Any], run_args: Mapping[str, Any] | None = None) -> str:
    """What ``arch="auto"`` decides for an HF export of these weights and why; an
    ``ExportError`` says why nothing fits (for Megatron weights: the planning's own check
    of the run's ``args`` against the shapes)."""
    if megatron_gpt.fits(tensors):
        return megatron_gpt.to_hf(tensors, None, run_args).reason
    found = detect(tensors)
    return found.reason + (": names kept" if found.naming == "hf" else "")


def to_hf(
    tensors: Mapping[str, Any],
    config: Mapping | None,
    arch: str = "auto",
    run_args: Mapping[str, Any] | None = None,
) -> Plan:
    """Plan a torchtitan (or Megatron-Core GPT) checkpoint's model weights -> HF names, or
    keep names that are HF's already (``reason`` says which arch); ``run_args``: the
    training run's arguments, where saved."""
    if arch == megatron_gpt.ARCH or (arch == "auto" and megatron_gpt.fits(tensors)):
        plan = megatron_gpt.to_hf(tensors, config, run_args)
        given = f"given as arch={arch!r}"
        return plan if arch == "auto" else dataclasses.replace(plan, reason=given)
    found = detect(tensors) if arch == "auto" else None
    chosen = found.arch if found else get(arch)
    if found and found.naming == "hf":
        plan = plan_identity(chosen, tensors, config)
        return dataclasses.replace(plan, reason=f"{found.reason}: names kept")
    plan = chosen.to_hf(tensors, config)
    return dataclasses.replace(
        plan, reason=found.reason if found else f"{arch}: given as arch={arch!r}"
    )


def from_hf(
    tensors: Mapping[str, Any],
    config: Mapping | None,
    arch: str = "auto",
    naming: str = "torchtitan",
) -> Plan:
    """Plan HF weights -> torchtitan names of ``naming`` (``reason`` says which arch)."""
    found = detect(tensors) if arch == "auto" else None
    chosen = found.arch if found else get(arch)
    if found and found.naming != "hf":
        raise ExportError(f"these keys are not HF names ({found.reason})")
    plan = chosen.from_hf(tensors, config, naming)
    return dataclasses.replace(
        plan, reason=found.reason if found else f"{arch}: given as arch={arch!r}"
    )


def _fit(arch: Architecture, naming: str, keys: dict[str, str]) -> _Fit:
    absent = [m for m in arch.markers if _example(_Fit(arch, naming, keys, [], []), m) is None]
    return _Fit(arch, naming, keys, unmatched(arch, keys, naming), absent)


def _example(fit: _Fit, marker: str) -> str | None:
    """A checkpoint key of the marker's rule, on the fit's side."""
    rule = next(r for r in fit.arch.rules if r.hf == marker)
    form, _ = template_form(rule.name(fit.naming))
    return next((fit.keys[k] for k in fit.keys if abstract(k) == form), None)


def _why_not(fit: _Fit) -> str:
    if fit.misses:
        return f"{fit.arch.name}: no rule for {fit.keys[fit.misses[0]]!r}"
    if fit.absent:
        rule = next(r for r in fit.arch.rules if r.hf == fit.absent[0])
        return f"{fit.arch.name}: no {rule.name(fit.naming)!r}"
    side = "HF names" if fit.naming == "hf" else NAMINGS[fit.naming]
    return f"{fit.arch.name} ({side}) fits too"
