"""Writing Megatron-Core ``torch_dist`` folders that ``dist_checkpointing.load`` accepts: a DCP
folder (:mod:`.writer`, stacked layers as one chunk per layer, as Megatron saves them), the
common state as the byte item ``common_state/shard_0_1`` (a ``torch.save`` of a one-element
list, as Megatron's ShardedObject saves it) and the ``metadata.json`` marker."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from inspector.formats.dcp.megatron import MARKER
from inspector.formats.dcp.writer import Chunk, write_dcp
from inspector.formats.writing import Item

COMMON_KEY = "common_state/shard_0_1"
MARKER_FIELDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
CHECKPOINT_VERSION = 3.0  # what megatron-core 0.19's save_checkpoint records


def saved_object(value: Any) -> bytes:
    """A sharded object's bytes as Megatron stores them: ``torch.save`` of ``[value]``."""
    import torch

    buffer = io.BytesIO()
    torch.save([value], buffer)
    return buffer.getvalue()


def extra_states(modules: Mapping[str, int], layers: int) -> dict[str, bytes]:
    """Each stacked module's per-layer ``_extra_state`` (None without Transformer Engine),
    which ``dist_checkpointing.load`` asks for by ``<module>._extra_state/shard_<i>_<L>``;
    a module of ``E`` experts (``modules[module]``) has one per layer and expert,
    ``shard_<i>.<e>_<L>.<E>``."""
    empty = saved_object(None)
    found = {}
    for layer in range(layers):
        for module, experts in modules.items():
            if experts:
                for e in range(experts):
                    found[f"{module}._extra_state/shard_{layer}.{e}_{layers}.{experts}"] = empty
            else:
                found[f"{module}._extra_state/shard_{layer}_{layers}"] = empty
    return found


def common_state(args: Mapping[str, Any], iteration: int = 0) -> bytes:
    """The common state Megatron's ``load_checkpoint`` reads: ``args`` (an argparse Namespace
    of the run's fields), ``checkpoint_version`` and ``iteration``; pickled by this package
    from plain values, never read back from a user's file."""
    state = {
        "args": argparse.Namespace(**args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    return saved_object(state)


def write_megatron(
    folder: Path,
    chunks: Sequence[Chunk],
    args: Mapping[str, Any],
    stacked_modules: Mapping[str, int],
    progress: Callable[[Item], None],
    overwrite: bool,
) -> list[Path]:
    """Write ``chunks``, the modules' empty extra states (one per layer of ``args``'
    ``num_layers``, and per expert) and the common state holding ``args`` as a torch_dist
    folder."""
    marker = json.dumps(MARKER_FIELDS).encode()
    objects = extra_states(stacked_modules, args["num_layers"])
    objects[COMMON_KEY] = common_state(args)
    return write_dcp(folder, chunks, progress, overwrite, objects, {MARKER: marker})
