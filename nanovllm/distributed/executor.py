"""Executors: how LLMEngine reaches the model runners, one per rank.

`run` executes a step and returns rank 0's sampled tokens; `launch`/`sample`/`settle` split it for async scheduling;
`collective_rpc` runs a ModelRunner method on every rank and returns each rank's result (weight updates and
sleep/wake go through it); `shutdown` frees everything. Two executors today: one rank in this process, and
tensor-parallel ranks in spawned processes (tensor_parallel.py); LLMEngine picks one. Data parallelism and Ray
are future executors, or a layer over several."""
from __future__ import annotations

import inspect

from nanovllm.config import Config
from nanovllm.engine.batch import LaunchedStep, PendingStep, ScheduledBatch, StepOutput
from nanovllm.engine.model_runner import ModelRunner


class Executor:
    runner: ModelRunner  # rank 0's, in this process
    num_kvcache_blocks: int  # blocks every rank holds; the scheduler's budget

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step on every rank; what rank 0 sampled."""
        raise NotImplementedError

    def launch(self, batch: ScheduledBatch, previous: PendingStep | None) -> LaunchedStep:
        """Queue a step's forward pass on every rank without waiting (async scheduling); inputs that `previous`
        sampled are taken on the device."""
        raise NotImplementedError(f"{type(self).__name__} does not support async scheduling")

    def sample(self, step: LaunchedStep) -> PendingStep:
        """Sample a launched step's tokens (rank 0), without waiting for them."""
        return self.runner.sample(step)

    def settle(self, step: PendingStep) -> StepOutput:
        """Wait for a launched step's tokens."""
        return self.runner.settle(step)

    def between_launch_and_sample(self, fn, *args):
        """fn(*args) on rank 0 after a step's launch and before its sample (settling the step before it)."""
        return fn(*args)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run ModelRunner.`method`(*args, **kwargs) on every rank; the results in rank order."""
        raise NotImplementedError

    def shutdown(self):
        raise NotImplementedError


def check_rpc_call(method, args: tuple, kwargs: dict) -> str:
    """Only public ModelRunner methods, with arguments they take: checked here, since a call that fails on a
    worker rank brings the engine down."""
    if not isinstance(method, str) or method.startswith("_") or not callable(getattr(ModelRunner, method, None)):
        public = sorted(m for m in vars(ModelRunner) if not m.startswith("_") and callable(getattr(ModelRunner, m)))
        raise ValueError(f"collective_rpc: {method!r} is not a public ModelRunner method; valid: {', '.join(public)}")
    try:
        inspect.signature(getattr(ModelRunner, method)).bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"collective_rpc: bad arguments for ModelRunner.{method}: {e}") from None
    return method


class UniprocExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, config: Config):
        self.runner = ModelRunner(config)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def run(self, batch):
        return self.runner.run(batch)

    def launch(self, batch, previous):
        return self.runner.launch(batch, previous)

    def collective_rpc(self, method, args=(), kwargs=None):
        kwargs = kwargs or {}
        return [getattr(self.runner, check_rpc_call(method, args, kwargs))(*args, **kwargs)]

    def shutdown(self):
        self.runner.release_graphs()
