"""Fused versions of the small elementwise ops, switched on by the CUDA model runner (unless enforce_eager):
Triton kernels for RMSNorm (with the residual add), SiLU-and-mul, q/k norm + rotary, the sampler's race and
penalties (layers/kernels/norm.py, activation.py, rope.py, race.py, penalties.py); torch.compile only for a rotary
embedding whose head size the rope kernel does not take. Eager, each op is a chain of tiny kernels; fused, one
kernel (on one H200 the first fused version, all torch.compile, took a decode step's forward from 8.6 to 5.2 ms:
docs/benchmarks.md).
No torch.compile on the usual path also keeps the inductor compile out of start-up. CPU runs stay plain torch.
NANOVLLM_COMPILE=0 keeps them eager, for comparison."""
import functools
import os

import torch
from torch import nn


@functools.cache
def compiled(fn):
    """One compiled version per function, shared by every layer (dynamic shapes: no recompiling per batch),
    compiled at its first call: torch.compile imports torch._dynamo, which took 4-8 s of an H200 machine's start-up
    for a function most models never call (the rope kernel takes their rotary)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _compile(fn)(*args, **kwargs)
    return call


@functools.cache
def _compile(fn):
    return torch.compile(fn, dynamic=True)


def use_compiled_ops(model: nn.Module, enabled: bool):
    """Switch every layer that has a compiled variant to it (or back to eager)."""
    enabled = enabled and os.environ.get("NANOVLLM_COMPILE", "1") != "0"
    for module in model.modules():
        if hasattr(module, "use_compiled"):
            module.use_compiled(enabled)
