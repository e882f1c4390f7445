"""torch.compile for the small elementwise ops (RMSNorm, SiLU-and-mul, rotary embedding).

Eager, each is a chain of tiny kernels; compiled, each becomes one fused kernel. Only the CUDA model
runner switches them on (CPU runs stay plain torch); NANOVLLM_COMPILE=0 keeps them eager for comparison."""
import functools
import os

import torch
from torch import nn


@functools.cache
def compiled(fn):
    """One compiled version per function, shared by every layer (dynamic shapes: no recompiling per batch)."""
    return torch.compile(fn, dynamic=True)


def compile_small_ops(model: nn.Module) -> bool:
    if os.environ.get("NANOVLLM_COMPILE", "1") == "0":
        return False
    for module in model.modules():
        if hasattr(module, "use_compiled"):
            module.use_compiled()
    return True
