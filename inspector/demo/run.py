"""A small training run saved the torchtitan way: ``step-N/`` DCP folders of the model and
the flattened AdamW state, written by a real training loop (one process).

Faults can be injected to show what run health finds: ``spike_at`` multiplies one layer's
learning rate by ``spike_factor`` for one training step (a loss spike from that layer);
``freeze_after`` stops one layer's training (``requires_grad=False``) after that step.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from inspector.demo.model import TinyLlamaConfig

RUN_CONFIG = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, hidden_dim=64)


@dataclass(frozen=True)
class RunPlan:
    """What to train and save: ``steps`` training steps, a save every ``save_every``; the
    faults (None: a healthy run) name a layer and a training step."""

    steps: int = 40
    save_every: int = 10
    lr: float = 1e-3
    spike_layer: int | None = None
    spike_at: int | None = None
    spike_factor: float = 300.0
    frozen_layer: int | None = None
    freeze_after: int | None = None
    config: TinyLlamaConfig = RUN_CONFIG
    batch: tuple[int, int] = (8, 16)


def build_run(out: str | os.PathLike, plan: RunPlan | None = None) -> Path:
    """Train TinyLlama with AdamW (one param group per layer and one for the rest) and save
    ``out/step-N/`` every ``plan.save_every`` steps; returns ``out``."""
    import torch

    plan = plan or RunPlan()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention
    try:
        return _train(Path(out), plan)
    finally:
        torch.set_num_threads(threads)


def _train(root: Path, plan: RunPlan) -> Path:
    import torch
    import torch.nn.functional as F

    from inspector.demo.model import build_model

    model = build_model(seed=0, cfg=plan.config)
    layers = {int(i): list(block.parameters()) for i, block in model.layers.items()}
    in_layers = {id(p) for ps in layers.values() for p in ps}
    rest = [p for p in model.parameters() if id(p) not in in_layers]
    groups = [{"params": ps} for ps in layers.values()] + [{"params": rest}]
    optim = torch.optim.AdamW(groups, lr=plan.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(7)
    for step in range(1, plan.steps + 1):
        tokens = torch.randint(0, plan.config.vocab_size, plan.batch, generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        spiked = optim.param_groups[plan.spike_layer or 0]
        if step == plan.spike_at and plan.spike_layer is not None:
            spiked["lr"] = plan.lr * plan.spike_factor
        optim.step()
        spiked["lr"] = plan.lr
        if step == plan.freeze_after and plan.frozen_layer is not None:
            for p in layers[plan.frozen_layer]:
                p.requires_grad_(False)
        if step % plan.save_every == 0:
            _save(root / f"step-{step}", model, optim)
    return root


def _save(path: Path, model: object, optim: object) -> None:
    """torchtitan's state: model weights at top level, the optimizer flattened by FQN."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        **get_model_state_dict(model),  # type: ignore[arg-type]
        "optimizer": get_optimizer_state_dict(model, optim, options=options),  # type: ignore[arg-type]
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
