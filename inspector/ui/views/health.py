"""The Audit tab's table: every problem the audit found, the gravest first, by key and file."""

from __future__ import annotations

from inspector.analysis.audit import AuditReport
from inspector.analysis.findings import SEVERITIES

COLUMNS = ("severity", "kind", "key", "file", "message")


def problem_rows(report: AuditReport) -> list[tuple[str, str, str, str, str]]:
    """One row per problem: errors, then warnings, then notes, each in the order found."""
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    ordered = sorted(report.problems, key=lambda p: rank[p.severity])
    return [(p.severity, p.kind, p.key or "", p.file or "", p.message) for p in ordered]


def keys_named(report: AuditReport) -> list[str]:
    """The keys the audit's errors name, in the order found."""
    return list(dict.fromkeys(p.key for p in report.problems if p.key and p.severity == "error"))
