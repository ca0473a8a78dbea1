"""Class 2, interrupts: Ctrl-C (a real SIGINT) during a real export of a genuine checkpoint.
torch's zip writer calls back into the exporter's sink; a KeyboardInterrupt surfacing in
that callback must not abort the process (PyTorchStreamWriter's destructor), must reach
the caller, and must leave no ``*.tmp`` file and no partial file under the final name.

Each case interrupts the export at every sink call of one kind in turn, or after delays
spread over a clean export's duration (also catching the verification read-back)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Interrupt, Spec


def _case(source: str, fmt: str, trigger: str, sources: Sources, tmp: Path, nested=False) -> Spec:
    interrupt = Interrupt(getattr(sources, source), fmt, trigger, nested=nested)
    return Spec(interrupt=interrupt)


CASES: dict[str, IsolatedGenerator] = {
    "interrupt:sink-write@pt": partial(_case, "seed", "pt", "write"),
    "interrupt:sink-seek@pt": partial(_case, "seed", "pt", "seek"),
    "interrupt:progress@pt": partial(_case, "seed", "pt", "progress"),
    "interrupt:timer@pt": partial(_case, "model_bin", "pt", "timer"),
    "interrupt:sink-write@pt-nested": partial(_case, "flat", "pt", "write", nested=True),
    "interrupt:timer@safetensors": partial(_case, "flat", "safetensors", "timer"),
    "interrupt:progress@safetensors": partial(_case, "seed", "safetensors", "progress"),
}
