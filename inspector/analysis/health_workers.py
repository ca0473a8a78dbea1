"""``health(workers=N)``: the parameters split across worker processes (from the fork server
of :mod:`inspector.processes`), in groups of about equal size taken in order, so the rows come
back in the order one process makes them and hold the same numbers. Each worker opens the
steps itself (once, kept for its next groups) and walks its parameters as one process does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from inspector import processes
from inspector.analysis import health_pass
from inspector.checkpoint import Checkpoint
from inspector.checkpoint import open as open_checkpoint
from inspector.errors import InspectorError
from inspector.formats.base import Step
from inspector.progress import Counter

GROUPS_PER_WORKER = 4  # smaller groups: progress to show, and the last worker less alone

Walked = tuple[list[Any], list[Any]]  # a parameter's rows and unreadable findings
Group = list[tuple[str, list[str | None]]]
# health's own steps, passed in (by reference: it imports this module)
# (name, per_step, opened, chosen, optimizer, counter, limits, workspace)
Walker = Callable[..., Walked]
Lister = Callable[[Checkpoint], dict[str, Any]]  # a step's optimizer state by parameter

# a worker's opened steps, their optimizer state and the workspace its groups share
Opened = tuple[list[Checkpoint], list[dict[str, Any]], health_pass.Workspace]
_opened: dict[tuple[str, ...], Opened] = {}


def walk(
    workers: int,
    chosen: Sequence[Step],
    storage_options: Mapping[str, Any] | None,
    params: Mapping[str, list[str | None]],
    sizes: Mapping[str, int],
    counter: Counter,
    limits: Any,
    steps: tuple[Walker, Lister],
) -> list[Walked]:
    """Each parameter's rows and unreadable findings, in ``params``' order; ``steps``:
    health's walk of one parameter and its optimizer-state lister."""
    groups = _groups(params, sizes, workers * GROUPS_PER_WORKER)
    options = dict(storage_options) if storage_options is not None else None
    context = processes.context(["torch", "inspector.analysis.health_workers"])
    pool = ProcessPoolExecutor(workers, mp_context=context)
    oom_kills = processes.oom_kills()
    walked: list[Walked] = []
    try:
        futures: list[Future] = [
            pool.submit(_walk_group, tuple(chosen), options, group, limits, steps)
            for group in groups
        ]
        for future, group in zip(futures, groups, strict=True):
            walked.extend(future.result())
            counter.step(sum(sizes[name] for name, _ in group))
    except BrokenProcessPool:  # from a result, or from a submit once a worker died
        cause = processes.death_cause(pool, oom_kills)
        raise InspectorError(f"a health worker process died: {cause}") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return walked


def _groups(
    params: Mapping[str, list[str | None]], sizes: Mapping[str, int], count: int
) -> list[Group]:
    """``params`` in order, cut into about ``count`` groups of about equal size."""
    target = max(1, sum(sizes.values()) // max(1, count))
    groups: list[Group] = [[]]
    filled = 0
    for name, per_step in params.items():
        if filled >= target:
            groups.append([])
            filled = 0
        groups[-1].append((name, per_step))
        filled += sizes[name]
    return [g for g in groups if g]


def _walk_group(
    chosen: tuple[Step, ...],
    storage_options: dict[str, Any] | None,
    group: Group,
    limits: Any,
    steps: tuple[Walker, Lister],
) -> list[Walked]:
    """In a worker: the group's parameters walked through the steps."""
    walk_one, optimizer_of = steps
    where = tuple(s.location for s in chosen)
    if where not in _opened:
        opened = [open_checkpoint(location, storage_options) for location in where]
        _opened[where] = opened, [optimizer_of(c) for c in opened], health_pass.Workspace()
    opened, optimizer, workspace = _opened[where]
    counter = Counter(0)
    with health_pass.one_thread():
        return [
            walk_one(name, per_step, opened, chosen, optimizer, counter, limits, workspace)
            for name, per_step in group
        ]
