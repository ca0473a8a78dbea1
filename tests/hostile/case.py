"""What a hostile case is: a damaged or malicious copy of a genuine checkpoint, and what the
inspector must do with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inspector.errors import InspectorError
from tests.fixtures import damage

if TYPE_CHECKING:
    from tests.hostile.isolated import Spec


@dataclass(frozen=True)
class Genuine:
    """Checkpoints written by the real producers (session fixtures), never modified."""

    seed: Path  # DCP, one process, one .distcp: 21 model tensors
    flat: Path  # DCP, two FSDP2 ranks: sharded tensors, optimizer state, objects
    safetensors: Path  # one safetensors file, every dtype
    hub: Path  # huggingface_hub shards + model.safetensors.index.json
    pt: Path  # torch.save of a nested training state
    model_bin: Path  # torch.save of a model state_dict
    legacy: Path  # torch.save in the pre-1.6 format
    distcp_safetensors: Path  # DCP FileSystemWriter(serialization_format=SAFETENSORS)

    def copy(self, name: str, dest: Path) -> Path:
        """A private copy of one of them, free to damage, inside ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        return damage.copy(getattr(self, name), dest)


@dataclass(frozen=True)
class Case:
    """A checkpoint at ``path`` and what opening, reading, diffing and exporting it must do.

    ``refused``: ``inspector.open`` raises ``error`` naming ``file``. Otherwise it opens,
    exactly the keys in ``bad`` are unreadable (each error names the key and ``file``) and
    every other entry reads the same as in ``reference``. Every error also says ``says``.
    ``marker`` must never appear and ``victim`` never disappear (payloads aim at them).
    """

    path: Path
    file: str | None = None
    says: str | None = None
    refused: bool = False
    bad: frozenset[str] = frozenset()
    error: type[InspectorError] = InspectorError
    reference: Path | None = None
    marker: Path | None = None
    victim: Path | None = None


Generator = Callable[[Genuine, Path], Case]


@dataclass(frozen=True)
class Sources:
    """What isolated cases (tests/hostile/isolated.py) are built from: ``Genuine`` and two
    more producer outputs."""

    genuine: Genuine
    fp8: Path  # DCP, two FSDP2 ranks, torchao float8 training wrappers around each weight
    dcp_hf: Path  # DCP HuggingFaceStorageWriter: safetensors carrying DCP_SHARDING_INFO

    def copy(self, name: str, dest: Path) -> Path:
        """A private copy of one of them (a ``Genuine`` field or ``fp8``/``dcp_hf``)."""
        dest.mkdir(parents=True, exist_ok=True)
        source = getattr(self.genuine, name, None) or getattr(self, name)
        return damage.copy(source, dest)

    def __getattr__(self, name: str) -> Path:
        return getattr(self.genuine, name)


IsolatedGenerator = Callable[[Sources, Path], "Spec"]
"""Builds one isolated case from the sources inside a folder of its own."""
