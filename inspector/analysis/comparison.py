"""Compare two checkpoints: keys paired by the FQN doctor (``key_map="auto"``), each pair
compared (equal fingerprint digests settle it without reading values), and the model
fingerprints of both sides (equal: the same model weights, whatever the layout).

:func:`compare` streams one pair at a time and reports progress in bytes; a set ``cancel``
event stops it between pairs (the app runs it in a worker thread).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from inspector.analysis.diff import COLUMNS, compare_pair, key_pairs, summarize
from inspector.analysis.fingerprint import model_digest
from inspector.checkpoint import Checkpoint
from inspector.progress import Counter, ProgressFn

if TYPE_CHECKING:
    import pandas


@dataclass(frozen=True)
class Comparison:
    """The diff table (``inspector.diff``'s columns) of ``a`` against ``b``, and the model
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
