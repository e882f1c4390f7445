"""Tensor parallelism: rank 0 spawns ranks 1..N-1 and drives them with a tiny RPC over shared memory.

Rank 0 (the user's process) schedules, samples and holds the tokenizer. `MultiprocExecutor` pickles
(method, (args, kwargs, reply)) into a shared-memory segment, wakes every worker through its own event and then runs the
method on rank 0's ModelRunner; each worker runs the same method on its shard of the weights, and the
collectives inside the model (all_reduce, gather) join the results. Workers answer only `collective_rpc`
calls (over their pipe); a step's tokens come from rank 0 alone. The channel is in channel.py;
docs/tensor_parallel.md has the whole design: rendezvous, failure handling and shutdown.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection, get_context, parent_process

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.distributed.channel import ChannelEnd, RpcChannel
from nanovllm.distributed.executor import Executor, check_rpc_call
from nanovllm.distributed.group import TPGroup
from nanovllm.distributed.process import leave_now
from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.model_runner import ModelRunner

logger = logging.getLogger("nanovllm")

# A collective, the rendezvous or a start-up step waiting longer than this fails instead of hanging
# (a worker that dies is noticed at once; this only bounds a worker that hangs).
TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 10.0  # how long shutdown waits for a worker to leave on its own before terminating it
FAILURE_GRACE_S = 5.0  # after a failed step, how long to wait for a worker's report that explains it


# A spawned process re-imports the user's script: one that builds an engine at module level starts another there.
SPAWN_HINT = ("; it died before starting: if your script builds the LLM at module level, put that under "
              "`if __name__ == \"__main__\":` (these processes are spawned and import the script again)")


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed (or the engine was shut down after a failure)."""


class MultiprocExecutor(Executor):
    """Rank 0's ModelRunner in this process; ranks 1..N-1 spawned, connected and driven by `Workers`."""

    def __init__(self, config: Config):
        check_tensor_parallel(config)
        self.workers = workers = Workers(config)
        self.runner = None
        try:
            self.runner = ModelRunner(config, 0, workers.group)
            workers.wait_for("ready")
        except BaseException as e:
            # A user error (a bad checkpoint, a KV cache too small) fails every rank alike: raise rank 0's.
            # Anything else may be a collective broken by a worker's failure: raise the worker's report.
            worker_failed = not isinstance(e, (ValueError, TypeError, WorkerError)) and workers.failed_soon(e)
            try:
                if self.runner is not None:
                    self.runner.release_graphs()
            finally:
                workers.shutdown()
            if worker_failed:
                raise workers.error() from e
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def run(self, batch: ScheduledBatch):
        return self.workers.call(self.runner, "run", (batch,))

    def launch(self, batch, previous):
        """Async scheduling: the workers launch the same step, taking the inputs `previous` sampled from their
        copy of its tokens (rank 0 broadcasts every step's tokens when it samples: ModelRunner.share_tokens)."""
        return self.workers.call(self.runner, "launch", (batch, previous),
                                 worker_call=("launch_chained" if previous is not None else "launch", (batch,)))

    def sample(self, step):
        return self.workers.guarded(self.runner, self.runner.sample, step)

    def between_launch_and_sample(self, fn, *args):
        """Part of the step: the workers wait in its token broadcast meanwhile, so a failure (a Ctrl-C while settling
        the step before) leaves them there and shuts them down, as a failure in the step itself does."""
        return self.workers.guarded(self.runner, fn, *args)

    def collective_rpc(self, method, args=(), kwargs=None):
        kwargs = kwargs or {}
        return self.workers.call(self.runner, check_rpc_call(method, args, kwargs), tuple(args), kwargs, reply=True)

    def shutdown(self):
        self.runner.release_graphs()
        self.workers.shutdown()


def check_tensor_parallel(config: Config):
    """Errors the user can fix, raised before any process starts."""
    n, hf = config.tensor_parallel_size, config.hf_config
    num_heads = hf.num_attention_heads
    sizes = {"num_attention_heads": num_heads,
             "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or num_heads,
             "vocab_size": hf.vocab_size,
             "intermediate_size": getattr(hf, "intermediate_size", None),
             "moe_intermediate_size": getattr(hf, "moe_intermediate_size", None)}  # each expert's, sharded alike
    for name, value in sizes.items():
        if value is not None and value % n:
            raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={n}; "
                             "choose a tensor_parallel_size that divides it")
    if config.device == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one per rank) but only "
                         f"{torch.cuda.device_count()} are visible")


def cpu_threads_per_rank(world_size: int) -> int:
    """Ranks on CPU share the cores: more threads than cores make every collective wait on a
    descheduled thread (on 2 cores, 3 threads run TP=2 about 15x slower than 2)."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ---- rank 0's side --------------------------------------------------------------------------------

class Workers:
    """Rank 0's handle on ranks 1..N-1: spawns them, drives them, watches them and shuts them down.

    A monitor thread reads each worker's pipe (start-up progress and error reports) and watches its
    process; the first failure is recorded, logged and makes every later call raise WorkerError.
    """

    def __init__(self, config: Config):
        n = config.tensor_parallel_size
        if config.device == "cpu" and torch.get_num_threads() > cpu_threads_per_rank(n):
            logger.info("tensor parallel on CPU: torch threads %d -> %d in this process, so the %d ranks "
                        "share the cores", torch.get_num_threads(), cpu_threads_per_rank(n), n)
            torch.set_num_threads(cpu_threads_per_rank(n))
        ctx = get_context("spawn")
        self.failure: str | None = None
        self.group: TPGroup | None = None
        self.processes, self._conns = [], []
        self._counts = {"started": 0, "ready": 0}
        self._replies: dict[int, object] = {}  # rank -> result of the current collective_rpc
        self._cond = threading.Condition()
        self._closing = self._closed = False
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.channel: RpcChannel | None = None
        timeout = timedelta(seconds=TIMEOUT_S)
        # Port 0: the OS picks a free port, so engines never collide; workers learn it from their arguments.
        self.store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=timeout)
        try:
            self.channel = RpcChannel.create(ctx, n - 1)
            for rank in range(1, n):
                recv_end, send_end = ctx.Pipe(duplex=False)
                process = ctx.Process(target=worker_main, name=f"nanovllm-tp{rank}", daemon=True,
                                      args=(config, rank, self.store.port, self.channel.ends[rank - 1], send_end,
                                            logger.getEffectiveLevel()))
                process.start()
                send_end.close()
                self.processes.append(process)
                self._conns.append(recv_end)
            self._monitor = threading.Thread(target=self._watch, name="nanovllm-tp-monitor", daemon=True)
            self._monitor.start()
            self.wait_for("started")  # a worker that cannot even start fails here, not in the rendezvous
            self.group = TPGroup(config.device, self.store, 0, n, timeout)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks over %s, channel %s", n, "NCCL" if self.group.is_nccl else "gloo",
                    self.channel.prefix)

    # -- watching --
    def _watch(self):
        waitables: dict = {}
        started: set[int] = set()
        for rank, (process, conn) in enumerate(zip(self.processes, self._conns), start=1):
            waitables[conn] = waitables[process.sentinel] = rank
        while waitables and not self._stop.is_set():
            ready = connection.wait(list(waitables), timeout=0.2)
            # messages before deaths: a worker writes its error report before it exits
            for obj in sorted(ready, key=lambda o: not isinstance(o, connection.Connection)):
                rank = waitables[obj]
                if isinstance(obj, connection.Connection):
                    try:
                        kind, text = obj.recv()
                    except (EOFError, OSError):
                        del waitables[obj]
                        continue
                    if kind == "error":
                        self._record_failure(f"a worker failure: tensor-parallel worker rank {rank} raised:\n{text}")
                    elif kind == "reply":
                        with self._cond:
                            self._replies[rank] = text
                            self._cond.notify_all()
                    else:
                        if kind == "started":
                            started.add(rank)
                        with self._cond:
                            self._counts[kind] += 1
                            self._cond.notify_all()
                else:
                    del waitables[obj]
                    process = self.processes[rank - 1]
                    process.join(1.0)
                    self._record_failure(f"a worker failure: tensor-parallel worker rank {rank} exited "
                                         f"unexpectedly (exit code {process.exitcode})"
                                         f"{'' if rank in started else SPAWN_HINT}")

    def _record_failure(self, text: str):
        with self._cond:
            if self.failure is not None or self._closing:
                return
            self.failure = text
            self._cond.notify_all()
        logger.error("%s", text)
        group = self.group  # shutdown may clear it meanwhile
        if group is not None:
            try:
                group.abort()  # free rank 0 from a collective that can no longer complete
            except Exception:
                logger.exception("aborting the tensor-parallel group failed")

    def error(self) -> WorkerError:
        return WorkerError(f"the engine was shut down after {self.failure}")

    def check(self):
        """Raise if a worker has failed or the workers are shut down."""
        if self.failure is not None:
            raise self.error()
        if self._closed:
            raise WorkerError("the tensor-parallel workers are shut down")

    def failed_soon(self, e: BaseException) -> bool:
        """After `e` on rank 0: has a worker failed, or does it report a failure within a short grace?"""
        with self._cond:
            if isinstance(e, Exception):  # not for Ctrl-C: that is rank 0's own
                self._cond.wait_for(lambda: self.failure is not None, FAILURE_GRACE_S)
            return self.failure is not None

    def _wait(self, done, what: str):
        """Wait until done() (under the lock), raising on a worker failure or after TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        with self._cond:
            while not done():
                if self.failure is not None:
                    raise self.error()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.failure = f"a worker failure: tensor-parallel workers did not {what} within {TIMEOUT_S:.0f}s"
                    raise self.error()
                self._cond.wait(min(remaining, 1.0))

    def wait_for(self, kind: str):
        """Wait until every worker has reported `kind` ("started" or "ready")."""
        self._wait(lambda: self._counts[kind] >= len(self.processes), f"become {kind}")

    # -- driving --
    def call(self, runner: ModelRunner, method: str, args: tuple, kwargs: dict | None = None, reply: bool = False,
             worker_call: tuple[str, tuple] | None = None):
        """Send `method` to every worker and run it on rank 0. Returns rank 0's result, or with `reply` every
        rank's result in rank order (workers send theirs back over their pipe). `worker_call`: (method, args) the
        workers run instead (rank 0's arguments may not travel: a pending step)."""
        self.check()
        kwargs = kwargs or {}

        def on_every_rank():
            self._replies.clear()
            self.channel.send(*(worker_call or (method, args)), kwargs, reply, check=self.check)
            result = getattr(runner, method)(*args, **kwargs)
            if reply:
                self._wait(lambda: len(self._replies) == len(self.processes), f"answer {method}")
                result = [result] + [self._replies[rank] for rank in range(1, len(self.processes) + 1)]
            return result
        return self.guarded(runner, on_every_rank)

    def guarded(self, runner: ModelRunner, fn, *args):
        """fn(*args) on rank 0 as part of a step the workers run too: a failure shuts the group down and raises the
        worker's report where a worker failed."""
        self.check()
        try:
            result = fn(*args)
        except WorkerError:
            self._shutdown_after_failure(runner)
            raise
        except BaseException as e:
            # Ranks are now out of step: a failed collective usually means a worker died, whose report
            # explains it; otherwise rank 0 itself failed. Either way the workers must go.
            worker_failed = self.failed_soon(e)
            with self._cond:
                if self.failure is None:
                    self.failure = f"an error on rank 0 during a tensor-parallel step ({type(e).__name__}: {e})"
            self._shutdown_after_failure(runner)
            if worker_failed:
                raise self.error() from e
            raise
        if self.failure is not None:  # NCCL: an aborted group can let the step finish with garbage
            self._shutdown_after_failure(runner)
            raise self.error()
        return result

    def _shutdown_after_failure(self, runner: ModelRunner):
        """Abort the group, then destroy rank 0's decode graphs: NCCL's abort finishes only once no graph
        holds the communicator (its kernels are released at once; the rest waits in a daemon thread)."""
        self.shutdown()
        try:
            runner.release_graphs()
        except Exception:
            logger.exception("destroying the decode graphs after a tensor-parallel failure failed")

    # -- shutting down --
    def shutdown(self):
        """Stop the workers (politely when healthy) and free the group, the channel and the store.
        Idempotent; never leaves a process or a shared-memory segment behind."""
        if self._closed:
            return
        with self._cond:
            self._closing = True  # workers leaving from now on are not failures
        healthy = self.failure is None and self.channel is not None and all(p.is_alive() for p in self.processes)
        if healthy:
            try:
                self.channel.send("exit", (), {}, False, timeout=EXIT_TIMEOUT_S)
            except Exception:
                healthy = False
        start = time.monotonic()
        # Close rank 0's side while the workers close theirs: NCCL's shutdown waits for every rank.
        if self.group is not None:
            try:
                self.group.close(healthy)
            except Exception:
                logger.exception("closing the tensor-parallel group failed")
            self.group = None
            logger.debug("tensor-parallel shutdown: group closed after %.2fs", time.monotonic() - start)
        deadline = time.monotonic() + (EXIT_TIMEOUT_S if healthy else 0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        logger.debug("tensor-parallel shutdown: workers left after %.2fs", time.monotonic() - start)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        self._closed = True
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        for conn in self._conns:
            conn.close()
        if self.channel is not None:
            self.channel.close()
        self.store = None


# ---- a worker's side ------------------------------------------------------------------------------

def worker_main(config: Config, rank: int, port: int, end: ChannelEnd, conn: connection.Connection,
                log_level: int = logging.WARNING):
    """Entry point of rank `rank` (1..N-1): build this rank's shard, then run what rank 0 sends until "exit".

    Any error is reported to rank 0 with its traceback, and the process exits at once: its closed
    connections make rank 0's pending collectives fail instead of waiting.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it then shuts us down
    handler = logging.StreamHandler()  # to the stderr inherited from rank 0, at rank 0's level
    handler.setFormatter(logging.Formatter(f"nanovllm rank {rank}: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(log_level)
    try:
        if config.device == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(config.tensor_parallel_size))
        channel = RpcChannel.attach(end)
        conn.send(("started", None))
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=timeout)
        group = TPGroup(config.device, store, rank, config.tensor_parallel_size, timeout)
        runner = ModelRunner(config, rank, group)
        conn.send(("ready", None))
        parent = parent_process()

        def parent_alive():
            if parent is not None and not parent.is_alive():
                raise SystemExit(0)  # rank 0 is gone: nobody will send "exit"

        while True:
            method, (args, kwargs, reply) = channel.recv(parent_alive)
            if method == "exit":
                break
            result = getattr(runner, method)(*args, **kwargs)
            if reply:
                conn.send(("reply", result))
        t = time.monotonic()
        runner.release_graphs()  # before the group: see ModelRunner.release_graphs
        logger.debug("graphs released in %.2fs", time.monotonic() - t)
    except SystemExit:
        os._exit(0)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)  # skip cleanup that could block on a broken group
    t = time.monotonic()
    channel.close()
    group.close()
    conn.close()
    logger.debug("group closed in %.2fs", time.monotonic() - t)
    leave_now(0)  # no interpreter teardown (distributed/process.py)
