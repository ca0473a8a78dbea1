"""Counts of the hostile corpus and the fuzz run, printed at the end of every pytest run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

_CORPUS = "tests/test_hostile.py::test_case"
_FUZZ = ("tests/test_fuzz.py", "tests/test_fuzz_structure.py")
_ISOLATED = "tests/test_hostile_isolated.py::test_isolated"


@dataclass
class Tally:
    """What ran: corpus cases with their slowest call and largest allocations; isolated
    cases with their outcomes; fuzz examples per family with the slowest one."""

    cases: int = 0
    slowest_call: tuple[float, str] = (0.0, "")
    traced_peak: tuple[int, str] = (0, "")
    rss_growth: tuple[int, str] = (0, "")
    examples: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    slowest_example: tuple[float, str] = (0.0, "")
    isolated: dict[str, str] = field(default_factory=dict)  # case -> outcome
    native: dict[str, float] = field(default_factory=dict)  # tests/native/drive.py's counts

    def measured(self, name: str, slowest: tuple[float, str], traced: int, rss: int) -> None:
        self.slowest_call = max(self.slowest_call, (slowest[0], f"{name}: {slowest[1]}"))
        self.traced_peak = max(self.traced_peak, (traced, name))
        self.rss_growth = max(self.rss_growth, (rss, name))

    def example(self, family: str, seconds: float, outcome: str) -> None:
        self.examples[family] += 1
        self.outcomes[outcome] += 1
        self.slowest_example = max(self.slowest_example, (seconds, family))

    def summary(self, failed_ids: list[str]) -> list[str]:
        """One line for the corpus and one for the fuzz run (if they ran)."""
        lines = []
        if self.cases:
            failures = sum(i.startswith(_CORPUS) for i in failed_ids)
            lines.append(
                f"hostile corpus: {self.cases} cases, {failures} failures; slowest call "
                f"{self.slowest_call[0]:.2f} s ({self.slowest_call[1]}); largest Python "
                f"allocation {self.traced_peak[0] / 2**20:.1f} MiB ({self.traced_peak[1]}); "
                f"largest RSS growth {self.rss_growth[0] / 2**20:.1f} MiB ({self.rss_growth[1]})"
            )
        if self.isolated:
            failures = sum(i.startswith(_ISOLATED) for i in failed_ids)
            outcomes = Counter(o.split("@")[0] for o in self.isolated.values())
            broken = ", ".join(f"{n} ({o})" for n, o in sorted(self.isolated.items()) if o != "ok")
            lines.append(
                f"isolated hostile cases: {len(self.isolated)}, {failures} failures; outcomes: "
                + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
                + (f"; broken: {broken}" if broken else "")
            )
        if self.examples:
            failures = sum(i.startswith(_FUZZ) for i in failed_ids)
            families = ", ".join(f"{k} {v}" for k, v in sorted(self.examples.items()))
            outcomes = ", ".join(f"{v} {k}" for k, v in sorted(self.outcomes.items()))
            lines.append(
                f"fuzz: {sum(self.examples.values())} examples ({families}), {failures} "
                f"failures; outcomes: {outcomes}; slowest example "
                f"{self.slowest_example[0]:.2f} s ({self.slowest_example[1]})"
            )
        if self.native:
            n = self.native
            lines.append(
                f"native decoders under ASan+UBSan: {n['boundaries']:.0f} boundary inputs, "
                f"{n['folders']:.0f} corpus folders native vs Python, {n['mutants']:.0f} "
                f"mutants in {n['seconds']} s ({n['mutants_opened']:.0f} opened both ways)"
            )
        return lines


TALLY = Tally()
