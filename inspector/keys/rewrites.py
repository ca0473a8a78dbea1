"""Candidate key rewrites that turn checkpoint keys into model keys, ranked by what they fix.

A rewrite has up to three steps: a prefix step (strip or add ``model.``, or a prefix
difference inferred from the unmatched keys), a naming-generation step (torchtitan's July
2025 names <-> its 0.3 names, :mod:`inspector.keys.generations`) and a wrapper step (drop a
wrapper segment such as ``_orig_mod.`` wherever it sits and put it back wherever the
model's keys have it).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inspector.keys.generations import GENERATIONS, Rename, renames_in, respell
from inspector.keys.spellings import (
    MODEL_PREFIX,
    MODEL_PREFIX_ORIGIN,
    WRAPPER_ORIGINS,
    WRAPPER_PREFIXES,
    has_segment,
    strip_segments,
)

Spec = tuple[tuple[int, ...] | None, str | None]
_INFER_SAMPLE = 2000
_INFERRED = 3
_SHOWN_ANCHORS = 3


@dataclass(frozen=True)
class PrefixStep:
    """Replace a leading ``old`` with ``new`` (either may be empty)."""

    old: str
    new: str

    def apply(self, key: str) -> str:
        return self.new + key[len(self.old) :] if key.startswith(self.old) else key

    @property
    def description(self) -> str:
        if not self.new:
            return f"strip {self.old!r}"
        if not self.old:
            return f"add {self.new!r}"
        return f"replace {self.old!r} with {self.new!r}"

    @property
    def origins(self) -> tuple[str, ...]:
        found = [MODEL_PREFIX_ORIGIN] if MODEL_PREFIX in (self.old, self.new) else []
        return (*found, *(WRAPPER_ORIGINS[p] for p in (self.old, self.new) if p in WRAPPER_ORIGINS))


@dataclass(frozen=True)
class WrapperStep:
    """Drop ``wrappers`` segments, then restore them where the model's keys have them."""

    wrappers: tuple[str, ...]
    description: str
    placements: Mapping[str, str] = field(repr=False, compare=False, hash=False)

    def apply(self, key: str) -> str:
        bare = strip_segments(key, self.wrappers)
        return self.placements.get(bare, bare)

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(WRAPPER_ORIGINS[w] for w in self.wrappers)


@dataclass(frozen=True)
class GenerationStep:
    """Respell torchtitan names of generation ``source`` as ``target`` spells them, where the
    respelled key is a model key once wrapper segments are set aside (a name both
    generations share, such as DeepSeek's ``attention.wq``, is left alone)."""

    source: str
    target: str
    renames: tuple[Rename, ...]
    model_keys: frozenset[str] = field(repr=False, compare=False, hash=False)

    def apply(self, key: str) -> str:
        renamed = respell(key, self.source, self.target)
        return renamed if strip_segments(renamed, WRAPPER_PREFIXES) in self.model_keys else key

    @property
    def description(self) -> str:
        shown = ", ".join(
            f"{r.spelling(self.source)} -> {r.spelling(self.target)}" for r in self.renames
        )
        return f"respell {GENERATIONS[self.source]} as {GENERATIONS[self.target]} ({shown})"

    @property
    def origins(self) -> tuple[str, ...]:
        changes = ", ".join(dict.fromkeys(r.change for r in self.renames))
        return (f"torchtitan renamed these modules between July 2025 and 0.3, PRs {changes}",)


Step = PrefixStep | GenerationStep | WrapperStep


@dataclass(frozen=True)
class Suggestion:
    """A rewrite of checkpoint keys and how many key mismatches it resolves."""

    steps: tuple[Step, ...]
    resolves: int
    remaining: int
    shape_mismatches: int

    @property
    def description(self) -> str:
        return " then ".join(s.description for s in self.steps)

    @property
    def why(self) -> str:
        """Where such a difference usually comes from."""
        return "; ".join(dict.fromkeys(o for s in self.steps for o in s.origins))

    def apply(self, key: str) -> str:
        return apply_steps(self.steps, key)

    def as_dict(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "steps": [s.description for s in self.steps],
            "resolves": self.resolves,
            "remaining": self.remaining,
            "shape_mismatches": self.shape_mismatches,
            "why": self.why,
        }


def apply_steps(steps: Sequence[Step], key: str) -> str:
    for step in steps:
        key = step.apply(key)
    return key


@dataclass(frozen=True)
class Score:
    """Key mismatches left after a rename, and the shape mismatches among the matches."""

    missing: int
    unexpected: int
    shape_mismatches: int


def _score(ours: Mapping[str, Spec], theirs: Mapping[str, Spec], renamed: Iterable[str]) -> Score:
    """Match the renamed checkpoint keys (in ``ours`` order) against the model's keys."""
    seen: set[str] = set()
    unexpected = shapes = 0
    for (shape, _), target in zip(ours.values(), renamed, strict=True):
        if target in theirs and target not in seen:
            seen.add(target)
            other = theirs[target][0]
            shapes += shape is not None and other is not None and shape != other
        else:
            unexpected += 1
    return Score(len(theirs) - len(seen), unexpected, shapes)


def suggest(
    ours: Mapping[str, Spec],
    theirs: Mapping[str, Spec],
    *,
    count_missing: bool = True,
    count_unexpected: bool = True,
) -> list[Suggestion]:
    """Rewrites that resolve at least one mismatch, best first; of rewrites that rename
    alike, only the first (simplest) is kept.

    ``count_missing=False`` (or ``count_unexpected=False``) scores only one side, for a
    model known only in part (DCP stops at its first missing key) or an optimizer that
    need not cover every model key.
    """

    def mismatches(s: Score) -> int:
        return s.missing * count_missing + s.unexpected * count_unexpected

    base = mismatches(_score(ours, theirs, ours))
    if base == 0:
        return []
    unmatched = [k for k in ours if k not in theirs]
    missing = [k for k in theirs if k not in ours]
    wrappers = tuple(
        w for w in WRAPPER_PREFIXES if any(has_segment(k, w) for k in itertools.chain(ours, theirs))
    )
    prefix_steps = _prefix_steps(unmatched, missing, wrappers)
    wrapper_steps = [_wrapper_step((w,), ours, theirs) for w in wrappers]
    if len(wrappers) > 1:
        wrapper_steps.append(_wrapper_step(wrappers, ours, theirs))

    def evaluate(steps: tuple[Step, ...]) -> tuple[Suggestion, tuple[str, ...]]:
        renamed = tuple(apply_steps(steps, k) for k in ours)
        s = _score(ours, theirs, renamed)
        return Suggestion(steps, base - mismatches(s), mismatches(s), s.shape_mismatches), renamed

    all_steps: list[Step] = [*prefix_steps, *wrapper_steps]
    singles = {step: evaluate((step,)) for step in all_steps}
    found = list(singles.values())
    for p, w in itertools.product(prefix_steps, wrapper_steps):
        both = evaluate((p, w))
        if both[0].resolves > max(singles[p][0].resolves, singles[w][0].resolves):
            found.append(both)
    bases = [((), 0), *((f[0].steps, f[0].resolves) for f in found)]
    for g in _generation_steps(unmatched, theirs):
        for steps, resolved in bases:
            prefix = tuple(s for s in steps if isinstance(s, PrefixStep))
            with_g = evaluate((*prefix, g, *(s for s in steps if isinstance(s, WrapperStep))))
            if with_g[0].resolves > resolved:
                found.append(with_g)
    found.sort(key=lambda f: (-f[0].resolves, f[0].shape_mismatches, len(f[0].steps)))
    ranked, seen = [], set()
    for suggestion, renamed in found:
        if suggestion.resolves > 0 and renamed not in seen:
            seen.add(renamed)
            ranked.append(suggestion)
    return ranked


def _generation_steps(unmatched: Sequence[str], theirs: Mapping[str, Spec]) -> list[GenerationStep]:
    """A respelling from each torchtitan generation whose names some unmatched keys use."""
    model_keys = frozenset(strip_segments(k, WRAPPER_PREFIXES) for k in theirs)
    steps = []
    for source, target in itertools.permutations(GENERATIONS, 2):
        renames = renames_in(list(unmatched[:_INFER_SAMPLE]), source)
        if renames:
            steps.append(GenerationStep(source, target, tuple(renames), model_keys))
    return steps


def _prefix_steps(
    unmatched: Sequence[str], missing: Sequence[str], wrappers: tuple[str, ...]
) -> list[PrefixStep]:
    steps = []
    if any(k.startswith(MODEL_PREFIX) for k in unmatched):
        steps.append(PrefixStep(MODEL_PREFIX, ""))
    if any(k.startswith(MODEL_PREFIX) for k in missing):
        steps.append(PrefixStep("", MODEL_PREFIX))
    steps += _inferred(unmatched, missing)
    if wrappers:
        steps += _inferred(
            [strip_segments(k, wrappers) for k in unmatched],
            [strip_segments(k, wrappers) for k in missing],
        )
    return list(dict.fromkeys(steps))


def _inferred(unmatched: Sequence[str], missing: Sequence[str]) -> list[PrefixStep]:
    """Prefix pairs that turn unmatched keys into missing ones sharing their longest suffix.

    A suffix shared with missing keys under several prefixes (``layers.0.`` and ``layers.1.``)
    casts no vote: it cannot tell which rewrite is meant.
    """
    index: dict[str, set[str]] = {}
    for key in missing:
        index.setdefault(key, set()).add("")
        pos = key.find(".")
        while pos != -1:
            index.setdefault(key[pos + 1 :], set()).add(key[: pos + 1])
            pos = key.find(".", pos + 1)
    votes: Counter[tuple[str, str]] = Counter()
    for key in unmatched[:_INFER_SAMPLE]:
        start = 0
        while True:
            prefixes = index.get(key[start:])
            if prefixes is not None and (start == 0 or "." in key[start:]):
                if len(prefixes) == 1 and key[:start] not in prefixes:
                    votes[key[:start], next(iter(prefixes))] += 1
                break
            pos = key.find(".", start)
            if pos == -1:
                break
            start = pos + 1
    return [PrefixStep(old, new) for (old, new), _ in votes.most_common(_INFERRED)]


def _wrapper_step(
    wrappers: tuple[str, ...], ours: Mapping[str, Spec], theirs: Mapping[str, Spec]
) -> WrapperStep:
    placements: dict[str, str] = {}
    ambiguous: set[str] = set()
    for key in theirs:
        bare = strip_segments(key, wrappers)
        if bare in placements:
            ambiguous.add(bare)
        placements[bare] = key
    for bare in ambiguous:
        del placements[bare]
    parts = [_describe_wrapper(w, ours, theirs) for w in wrappers]
    return WrapperStep(wrappers, " and ".join(parts), placements)


def _describe_wrapper(wrapper: str, ours: Mapping[str, Spec], theirs: Mapping[str, Spec]) -> str:
    anchors = list(dict.fromkeys(_anchor(k, wrapper) for k in theirs if has_segment(k, wrapper)))
    if not anchors:
        return f"strip {wrapper!r}"
    verb = "move" if any(has_segment(k, wrapper) for k in ours) else "add"
    if anchors == [""]:
        return f"{verb} {wrapper!r} at the start"
    shown = ", ".join(a or "the start" for a in anchors[:_SHOWN_ANCHORS])
    more = len(anchors) - _SHOWN_ANCHORS
    return f"{verb} {wrapper!r} after {shown}" + (f" and {more} more" if more > 0 else "")


def _anchor(key: str, wrapper: str) -> str:
    """The module path in front of the wrapper segment ('' when the key starts with it)."""
    return "" if key.startswith(wrapper) else key[: key.index(f".{wrapper}")]
