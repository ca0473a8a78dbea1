"""The audit's vocabulary: each kind of problem, how grave it is and what it means, and the
``Problem`` record that reports one (key, file, kind, message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SEVERITIES = ("error", "warning", "info")

# kind -> (severity, what it means). "error": the checkpoint is damaged, unfinished or cannot
# resume as it is; "warning": it may work, but look; "info": what could not be checked.
KINDS: dict[str, tuple[str, str]] = {
    "unfinished": ("error", "the save did not finish"),
    "missing-file": ("error", "a file the checkpoint names is missing or unusable"),
    "truncated": ("error", "a file is shorter than the records it should hold"),
    "crc-mismatch": ("error", "stored bytes differ from the CRC-32 their file keeps"),
    "damaged": ("error", "a record, header or index line that cannot be used"),
    "unreadable": ("error", "an entry that cannot be read (found when opening or reading)"),
    "missing-state": ("error", "a trained parameter lacks optimizer state"),
    "state-shape": ("error", "optimizer state shaped unlike its parameter"),
    "orphan-state": ("error", "optimizer state for parameters the model part lacks"),
    "missing-component": ("error", "training state a resume loads is missing"),
    "dataloader-ranks": ("error", "dataloader states missing for some data-parallel ranks"),
    "non-finite": ("error", "NaN or infinite values"),
    "no-state": ("warning", "parameters without any optimizer state (frozen, or dropped?)"),
    "dtype": ("warning", "optimizer moments in lower precision than their parameters"),
    "step-mismatch": ("warning", "step counters that disagree"),
    "leftover": ("warning", "files an unfinished save left beside this checkpoint"),
    "unchecked": ("info", "records saved without CRC-32: their bytes cannot be verified"),
    "no-checksums": ("info", "the format keeps no checksums: sizes and offsets checked only"),
    "model-only": ("info", "weights only: nothing to resume training from"),
    "absent-component": ("info", "training state a resume may load is absent (producer unknown)"),
}


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding: the key and file it is about (None where it concerns neither), its
    ``kind`` (a key of ``KINDS``) and a message that says what is wrong in plain words."""

    key: str | None
    file: str | None
    kind: str
    message: str

    @property
    def severity(self) -> str:
        return KINDS[self.kind][0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "file": self.file,
            "kind": self.kind,
            "severity": self.severity,
            "message": self.message,
        }
