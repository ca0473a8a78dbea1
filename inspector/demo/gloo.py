"""Run a function on local gloo ranks in spawned processes (demo and test checkpoints).

Each rank joins the process group before ``fn(rank, world_size, *args)`` runs and, after
it returns, waits at a barrier before tearing the group down, then leaves without the
interpreter's shutdown: gloo worker threads still holding finished work objects can abort
a process during finalization ("terminate called without an active exception").
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raises if any fails.

    ``fn`` must be a module-level function (spawned processes import it).
    """
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(world_size, _free_port(), fn, args),
        nprocs=world_size,
        start_method="spawn",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
