"""Fused versions of the small elementwise ops: torch.compile for RMSNorm (with the residual add) and the
sampler's race, Triton kernels for SiLU-and-mul and for q/k norm + rotary (layers/kernels/activation.py, rope.py).

Eager, each is a chain of tiny kernels; fused, one kernel. The CUDA model runner switches them on (unless
enforce_eager); on one H200 compiling them took a decode step's forward from 8.6 to 5.2 ms (docs/benchmarks.md).
CPU runs stay plain torch. NANOVLLM_COMPILE=0 keeps them eager, for comparison."""
import functools
import os

import torch
from torch import nn


@functools.cache
def compiled(fn):
    """One compiled version per function, shared by every layer (dynamic shapes: no recompiling per batch)."""
    return torch.compile(fn, dynamic=True)


def use_compiled_ops(model: nn.Module, enabled: bool):
    """Switch every layer that has a compiled variant to it (or back to eager)."""
    enabled = enabled and os.environ.get("NANOVLLM_COMPILE", "1") != "0"
    for module in model.modules():
        if hasattr(module, "use_compiled"):
            module.use_compiled(enabled)
