"""torchtitan's two naming generations of model FQNs and the renames between them.

July 2025 (v0.2.x) names sit directly on the modules (``attention.wq``, ``output``,
``moe.experts.w1``); torchtitan 0.3 renamed them (PRs #2878 ``qkv_linear``, #2937
``lm_head``, #3626 axis-suffixed expert names, #3859 ``routed_experts.inner_experts``).
Defined once here: the FQN doctor rewrites keys with it and the HF adapters derive their
July-2025 names from their 0.3 names with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

GENERATIONS = {
    "torchtitan": "torchtitan 0.3 names",
    "torchtitan-2025": "torchtitan July-2025 names",
}
NEWEST = "torchtitan"


@dataclass(frozen=True)
class Rename:
    """Dotted segments spelled ``new`` by torchtitan 0.3 and ``old`` in July 2025."""

    new: str
    old: str
    change: str

    def spelling(self, generation: str) -> str:
        return self.new if generation == NEWEST else self.old

    @cached_property
    def _patterns(self) -> dict[str, re.Pattern[str]]:
        """Per generation: its spelling as whole segments of a key."""
        return {
            g: re.compile(rf"(?<![^.]){re.escape(self.spelling(g))}(?![^.])") for g in GENERATIONS
        }

    def found_in(self, key: str, generation: str) -> bool:
        return self._patterns[generation].search(key) is not None

    def apply(self, key: str, source: str, target: str) -> str:
        return self._patterns[source].sub(self.spelling(target), key)


RENAMES = (
    Rename("attention.qkv_linear.wq", "attention.wq", "#2878"),
    Rename("attention.qkv_linear.wk", "attention.wk", "#2878"),
    Rename("attention.qkv_linear.wv", "attention.wv", "#2878"),
    Rename("lm_head.weight", "output.weight", "#2937"),
    Rename("moe.routed_experts.inner_experts.w1_EFD", "moe.experts.w1", "#3626, #3859"),
    Rename("moe.routed_experts.inner_experts.w3_EFD", "moe.experts.w3", "#3626, #3859"),
    Rename("moe.routed_experts.inner_experts.w2_EDF", "moe.experts.w2", "#3626, #3859"),
    Rename("moe.expert_bias_E", "moe.expert_bias", "#3626"),
    Rename("moe.tokens_per_expert_E", "moe.tokens_per_expert", "#3626"),
)


def respell(key: str, source: str, target: str) -> str:
    """``key`` (spelled as generation ``source``) as generation ``target`` spells it."""
    if source == target:
        return key
    for rename in RENAMES:
        key = rename.apply(key, source, target)
    return key


def renames_in(keys: list[str], source: str) -> list[Rename]:
    """The renames whose ``source`` spelling occurs in some of ``keys``."""
    return [r for r in RENAMES if any(r.found_in(k, source) for k in keys)]
