"""Badges on tree rows (FP8 / subclass / error) and the "FP8 only" / "errors only" filters.

A leaf's badges come from what is known of its key so far (a scan's detection, scale
pairing, damage found, the audit's errors), looked up for the visible rows only.
:meth:`KeyFlags.refresh`, run once the header's scan and audit are done (in the worker
thread), collects the flagged keys, so the filters and the counts on inner rows are set
lookups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from inspector.analysis.audit import AuditReport
from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.keys.spellings import VIEWS, view_key
from inspector.ui.views.findings import subclass_kind

BADGES = ("FP8", "subclass", "error")
# What the tree shows: label -> the badge its keys must carry (None: every key).
SHOWS = {"all keys": None, "FP8 only": "FP8", "errors only": "error"}


class KeyFlags:
    """Which keys carry which badge: ``FP8`` (a training wrapper, a quantized payload or a
    float8 weight with its scale), ``subclass`` (another tensor subclass), ``error``
    (unreadable, or named by one of the audit's errors)."""

    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck
        self.audit_errors: dict[str, str] = {}
        self.flagged: dict[str, set[str]] = {b: set() for b in BADGES}
        self.ready = False
        self._counts: dict[tuple[str, str], Counter[str]] = {}
        self._within_of: frozenset[str] | None = None  # the keys ``_within`` counted
        self._within: dict[tuple[str, str], Counter[str]] = {}

    def badges(self, key: str) -> list[str]:
        """The badges of one key, from what is known now (a few lookups, nothing read)."""
        found = []
        detection = self.ck.scanned(key)
        kind = subclass_kind(detection) if detection is not None else None
        if kind in ("wrapper", "payload") or key in self.ck.scale_pairs.by_weight:
            found.append("FP8")
        elif kind == "unknown":
            found.append("subclass")
        if self.ck.facts(key).error or key in self.audit_errors:
            found.append("error")
        return found

    def scheme(self, key: str) -> str | None:
        """How a quantized weight is stored, for its badge: its ``fp8`` fact (the
        compressed-tensors scheme, a torchao payload's data and scale, a float8 weight's
        scale); None for other keys, training wrappers included (their weight is plain)."""
        detection = self.ck.scanned(key)
        quantized = (
            key in self.ck.logical
            or key in self.ck.scale_pairs.by_weight
            or (detection is not None and subclass_kind(detection) == "payload")
        )
        return self.ck.facts(key).fp8 if quantized else None

    def refresh(self, audit: AuditReport | None = None) -> None:
        """Collect every flagged key and count them below each node of every view (passes
        over the keys: run it off the kernel's thread)."""
        if audit is not None:
            self.audit_errors = {
                p.key: p.message for p in audit.problems if p.key and p.severity == "error"
            }
        flagged: dict[str, set[str]] = {b: set() for b in BADGES}
        for key in self.ck.keys():
            for badge in self.badges(key):
                flagged[badge].add(key)
        counts = {(v, b): self._below(flagged[b], v) for v in VIEWS for b in BADGES}
        self.flagged, self._counts, self.ready = flagged, counts, True
        self._within_of = None

    def select(self, entries: Iterable[Entry], show: str) -> list[Entry]:
        """The entries the ``show`` choice (a key of ``SHOWS``) keeps."""
        badge = SHOWS[show]
        if badge is None:
            return list(entries)
        if not self.ready:
            self.refresh()
        keep = self.flagged[badge]
        return [e for e in entries if e.key in keep]

    def count_below(
        self, prefix: str, view: str, badge: str, within: frozenset[str] | None = None
    ) -> int:
        """How many keys carrying ``badge`` lie below the node ``prefix`` of a ``view``
        (``within``: counting only those keys, the ones a filter kept)."""
        if within is None:
            return self._count(view, badge)[prefix]
        if within is not self._within_of:
            self._within_of, self._within = within, {}
        if (view, badge) not in self._within:
            self._within[(view, badge)] = self._below(self.flagged[badge] & within, view)
        return self._within[(view, badge)][prefix]

    def _count(self, view: str, badge: str) -> Counter[str]:
        if (view, badge) not in self._counts:
            self._counts[(view, badge)] = self._below(self.flagged[badge], view)
        return self._counts[(view, badge)]

    def _below(self, keys: set[str], view: str) -> Counter[str]:
        """Keys per node prefix (every ancestor of each key) in ``view``."""
        counts: Counter[str] = Counter()
        for key in keys:
            parts = view_key(self.ck.entry(key), view).split(".")
            counts.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return counts
