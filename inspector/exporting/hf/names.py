"""Name templates: ``layers.{layer}.x`` against keys like ``layers.3.x``.

Layer and expert numbers are whole dot-separated segments (the 1 of ``w1`` is not a slot),
so a key and a template match when they agree once every number / slot reads ``{}``.
"""

from __future__ import annotations

import re
from functools import lru_cache

NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")
SLOT = re.compile(r"(?<![^.])\{(\w+)\}(?![^.])")


@lru_cache(maxsize=1 << 18)
def abstract(key: str) -> str:
    """``key`` with each number segment as ``{}`` (cached: detection asks many times)."""
    return NUMBER.sub("{}", key)


@lru_cache(maxsize=1024)
def template_form(template: str) -> tuple[str, tuple[str, ...]]:
    """(``template`` with each slot as ``{}``, the slot names in order)."""
    return SLOT.sub("{}", template), tuple(SLOT.findall(template))


def slot_values(key: str, slots: tuple[str, ...]) -> dict[str, int]:
    """The numbers of ``key`` under the slot names of its template."""
    return dict(zip(slots, map(int, NUMBER.findall(key)), strict=True))
