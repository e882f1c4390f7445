"""Tensor-parallel process groups.

Each engine owns its own group, never torch's default one (`init_process_group`), so that several
engines, each with its own workers, can live in one process. Layers take the group they are built
for (inside `building_for(group)`) and use it in forward; outside that scope they build unsharded.
"""
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


class TPGroup:
    """One engine's ranks: NCCL on CUDA, gloo on CPU. Collectives time out after `timeout` instead of
    waiting forever for a rank that is gone."""

    def __init__(self, device: str, store: dist.Store, rank: int, size: int, timeout: timedelta):
        self.rank, self.size, self.is_nccl = rank, size, device == "cuda"
        if self.is_nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)  # connects lazily, at the first collective
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)  # connects every pair now

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        self.pg.allreduce([x], op).wait()
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank `dst` (None elsewhere)."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else []
        self.pg.gather(parts, x, dst).wait()
        return parts if self.rank == dst else None

    def min(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def abort(self):
        """Make collectives that wait on a dead rank fail. Gloo notices a closed connection by
        itself; NCCL kernels would wait forever, so abort its communicators."""
        if self.is_nccl:
            self.pg.abort()

    def close(self, healthy: bool = True):
        if self.is_nccl:
            self.pg.shutdown() if healthy else self.pg.abort()
        self.pg = None


_building: TPGroup | None = None


@contextmanager
def building_for(group: TPGroup | None) -> Iterator[None]:
    """Layers created inside this scope shard themselves for `group` (None: a single rank)."""
    global _building
    outer, _building = _building, group
    try:
        yield
    finally:
        _building = outer


def get_tp_group() -> TPGroup | None:
    return _building


def get_tp_rank() -> int:
    return _building.rank if _building is not None else 0


def get_tp_size() -> int:
    return _building.size if _building is not None else 1


def all_reduce(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        group.all_reduce(x)
    return x
