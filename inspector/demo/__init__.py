"""Build small torchtitan-style demo checkpoints with the real torch code paths.

``python -m inspector.demo OUT_DIR`` writes ``flat/``, ``prefixed/``, ``fp8/`` (2 gloo
processes, FSDP2 ``fully_shard`` on a CPU mesh, so tensors are split into chunks across
``__0_0.distcp`` and ``__1_0.distcp``), ``seed/`` (model only, one process) and
``llama_hf/`` (a torchtitan 0.3 Llama checkpoint plus the HF assets an HF export copies,
:mod:`inspector.demo.llama_hf`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEMO_CHECKPOINTS = ("flat", "prefixed", "seed", "fp8")
TRAIN_STEPS = 2


def build_demo(out_dir: str | os.PathLike, *, world_size: int = 2) -> dict[str, Path]:
    """Write every demo checkpoint under ``out_dir`` and return ``{name: path}``."""
    from inspector.demo.gloo import run_ranks
    from inspector.demo.llama_hf import HF_DEMO, build_llama_hf

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _save_seed(out / "seed")
    run_ranks(_train_and_save, str(out), world_size=world_size)
    return {name: out / name for name in DEMO_CHECKPOINTS} | {HF_DEMO: build_llama_hf(out)}


def _save_seed(path: Path) -> None:
    """A torchtitan seed checkpoint: model weights only, flat keys, one process, no collectives."""
    import torch.distributed.checkpoint as dcp

    from inspector.demo.model import build_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            build_model().state_dict(), storage_writer=dcp.FileSystemWriter(path), no_dist=True
        )


def _train_and_save(rank: int, world_size: int, out: str) -> None:
    model, optim, sched = _trained(rank, world_size, fp8=False)
    _save(Path(out) / "flat", model, optim, sched, rank, prefixed=False)
    _save(Path(out) / "prefixed", model, optim, sched, rank, prefixed=True)
    model, optim, sched = _trained(rank, world_size, fp8=True)
    _save(Path(out) / "fp8", model, optim, sched, rank, prefixed=False)


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from ``logger_name`` while the block runs."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def float8_training() -> tuple[Any, Any]:
    """torchao's ``Float8LinearConfig`` and ``convert_to_float8_training``, imported without
    its noise: "Failed to load _C_mxfp8..." (GPU kernels, not needed here) and torch's
    deprecation note on the enum torchao registers with pytree."""
    with _quiet("torchao"), _quiet("torch.utils._pytree"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return Float8LinearConfig, convert_to_float8_training


def _trained(rank: int, world_size: int, *, fp8: bool) -> tuple[Any, Any, Any]:
    """FSDP2-sharded TinyLlama after TRAIN_STEPS AdamW steps; fp8 wraps Linear weights (torchao)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from inspector.demo.model import build_model

    model = build_model()
    if fp8:
        Float8LinearConfig, convert_to_float8_training = float8_training()
        convert_to_float8_training(
            model,
            config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda mod, fqn: fqn != "output",
        )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 10))
    torch.manual_seed(1234 + rank)
    for _ in range(TRAIN_STEPS):
        if fp8:
            # float8 matmuls need a GPU; synthesise gradients so AdamW still builds real state.
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3)
        else:
            tokens = torch.randint(0, model.config.vocab_size, (2, 16))
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    return model, optim, sched


def _save(path: Path, model: Any, optim: Any, sched: Any, rank: int, *, prefixed: bool) -> None:
    """Save the way torchtitan's CheckpointManager does (before or after its PR #1347)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(
        model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    dataloader_state = {"sample_idx": 32 * TRAIN_STEPS + rank, "epoch": 0, "rank": rank}
    state = {
        "optimizer": optim_sd,
        "lr_scheduler": sched.state_dict(),
        "dataloader": {f"dp_rank_{rank}": pickle.dumps(dataloader_state)},
        "train_state": {
            "step": torch.tensor(TRAIN_STEPS, dtype=torch.int32),
            "ntokens_seen": torch.tensor(TRAIN_STEPS * 2 * 15, dtype=torch.int64),
        },
    }
    if prefixed:
        state["model"] = model_sd
    else:
        state.update(model_sd)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
