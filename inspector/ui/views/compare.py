"""Compare the open checkpoint with another: keys paired by the FQN doctor (``key_map="auto"``),
each pair compared (equal fingerprint digests settle it without reading values), the
model fingerprints of both sides, and the per-layer differences.

:func:`compare` streams one pair at a time and reports progress in bytes; a set ``cancel``
event stops it between pairs (run it in a :class:`~inspector.ui.views.jobs.Job`).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from inspector.analysis.diff import COLUMNS, STATUSES, compare_pair, key_pairs, summarize
from inspector.analysis.fingerprint import model_digest
from inspector.checkpoint import Checkpoint
from inspector.progress import Counter, ProgressFn

if TYPE_CHECKING:
    import pandas

# The diff table as the Compare tab shows it: column -> heading.
SHOWN_COLUMNS = {
    "status": "status",
    "key": "key",
    "key_b": "key in other",
    "dtype_a": "dtype",
    "dtype_b": "dtype in other",
    "max_abs_diff": "max abs diff",
    "max_rel_diff": "max rel diff",
}


@dataclass(frozen=True)
class Comparison:
    """The diff table (``inspector.diff``'s columns), the rows per status, and the model
    fingerprint digests of both sides (equal: the same model weights, whatever the layout)."""

    a: str
    b: str
    table: pandas.DataFrame
    digest_a: str
    digest_b: str
    model_only: bool

    @property
    def counts(self) -> dict[str, int]:
        return summarize(self.table)

    @property
    def fingerprints_equal(self) -> bool:
        return self.digest_a == self.digest_b

    @property
    def same(self) -> bool:
        """Every compared key is the same on both sides (bits, dtype and shape)."""
        return bool(len(self.table)) and bool((self.table["status"] == "same").all())

    def rows(self, limit: int | None = None) -> list[tuple[object, ...]]:
        """The shown columns, keys that differ first, in stored order within each status."""
        order = {s: i for i, s in enumerate(reversed(STATUSES))}
        ranked = self.table.assign(rank=self.table["status"].map(order)).sort_values(
            "rank", kind="stable"
        )
        picked = ranked[list(SHOWN_COLUMNS)].head(limit) if limit else ranked[list(SHOWN_COLUMNS)]
        return [tuple(_shown(v) for v in row) for row in picked.itertuples(index=False)]


def _shown(value: object) -> object:
    if isinstance(value, float):
        return "" if value != value else f"{value:.3g}"  # NaN: not compared
    return "" if value is None else value


def compare(
    ck: Checkpoint,
    other: Checkpoint,
    *,
    model_only: bool = True,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> Comparison:
    """Pair the keys (``key_map="auto"``), compare each pair with fingerprints, and digest
    both sides' model weights from the tensor digests found (``model_only``: pairs whose
    entries are model weights on either side)."""
    import pandas

    pairs = key_pairs(ck, other, "auto")
    if model_only:
        pairs = [
            (ka, kb)
            for ka, kb in pairs
            if (ka is not None and ck.entry(ka).component == "model")
            or (kb is not None and other.entry(kb).component == "model")
        ]
    sizes = [
        (ck.entry(ka).nbytes if ka else 0) + (other.entry(kb).nbytes if kb else 0)
        for ka, kb in pairs
    ]
    counter = Counter(sum(sizes), on_progress, cancel)
    counter.step(0)
    rows = []
    for (ka, kb), size in zip(pairs, sizes, strict=True):
        rows.append(compare_pair(ck, ka, other, kb, fingerprints=True))
        counter.step(size)
    table = pandas.DataFrame.from_records([asdict(r) for r in rows], columns=COLUMNS)
    digests_a = {r.key: r.hash_a for r in rows if r.kind == "tensor" and r.hash_a}
    digests_b = {r.key_b: r.hash_b for r in rows if r.kind == "tensor" and r.key_b and r.hash_b}
    return Comparison(
        ck.location,
        other.location,
        table,
        model_digest(ck, digests_a),
        model_digest(other, digests_b),
        model_only,
    )
