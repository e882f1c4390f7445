"""Tensor-parallel process groups.

Each engine owns its own group, never torch's default one (`init_process_group`), so that several
engines, each with its own workers, can live in one process. Layers take the group they are built
for (inside `building_for(group)`) and use it in forward; outside that scope they build unsharded.
"""
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("nanovllm")

TEARDOWN_S = 5.0  # the longest rank 0 waits for NCCL to shut a communicator down


def _in_background(call: Callable[[], None], what: str, wait_s: float):
    """Run an NCCL teardown call in a daemon thread and wait at most `wait_s` for it. NCCL can block in these
    (a peer that is gone, a CUDA graph still holding the communicator); a shutdown must never hang."""
    def run():
        try:
            call()
        except Exception:
            logger.exception("NCCL %s failed", what)
    thread = threading.Thread(target=run, name=f"nanovllm-nccl-{what}", daemon=True)
    thread.start()
    thread.join(wait_s)
    if wait_s and thread.is_alive():
        logger.warning("NCCL %s did not finish within %.0fs; leaving it to finish in the background", what, wait_s)


class TPGroup:
    """One engine's ranks: NCCL on CUDA, gloo on CPU. Collectives time out after `timeout` instead of
    waiting forever for a rank that is gone."""

    def __init__(self, device: str, store: dist.Store, rank: int, size: int, timeout: timedelta):
        self.rank, self.size, self.is_nccl = rank, size, device == "cuda"
        self._torn_down = False
        # Held while a collective is issued and while teardown starts: once an abort has begun, no collective
        # may enter the communicator (torch's abort holds the group's own lock until NCCL is done, which is
        # never while a CUDA graph still holds the communicator), so later ones raise instead of blocking.
        self._lock = threading.Lock()
        if self.is_nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)  # connects lazily, at the first collective
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)  # connects every pair now

    def _issue(self, collective: Callable[[], dist.Work]) -> dist.Work:
        with self._lock:
            if self._torn_down:
                raise RuntimeError("the tensor-parallel group was aborted or closed (a rank failed or the engine "
                                   "was shut down)")
            return collective()

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        self._issue(lambda: self.pg.allreduce([x], op)).wait()
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank `dst` (None elsewhere)."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else []
        self._issue(lambda: self.pg.gather(parts, x, dst)).wait()
        return parts if self.rank == dst else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` into `x` on every rank (NCCL: the current stream waits, not the host)."""
        self._issue(lambda: self.pg.broadcast(x, src)).wait()
        return x

    def min(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def abort(self):
        """Make collectives that wait on a dead rank fail. Gloo notices a closed connection by
        itself; NCCL kernels would wait forever, so abort its communicators."""
        self._tear_down(healthy=False)

    def close(self, healthy: bool = True):
        """Healthy: every rank closes after its CUDA graphs are gone (ModelRunner.release_graphs)."""
        self._tear_down(healthy)
        self.pg = None

    def _tear_down(self, healthy: bool):
        """Shut the NCCL communicator down (or abort it) once: the monitor thread may abort it while the
        main thread closes it, and two teardowns of one communicator must never run at once."""
        with self._lock:
            pg = self.pg if self.is_nccl and not self._torn_down else None
            self._torn_down = True
        if pg is None:
            return
        if healthy:
            _in_background(pg.shutdown, "shutdown", TEARDOWN_S)
        else:  # its kernels stop at once; the rest waits until the caller has destroyed its graphs
            _in_background(pg.abort, "abort", 0)


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
