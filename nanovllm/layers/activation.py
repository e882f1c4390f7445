import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> silu(first half) * second half."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)  # in place: a second fresh output is costly on CPU for a long prefill


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2d] -> gelu_tanh(first half) * second half (Gemma's MLP); on CUDA one Triton pass
        (kernels/activation.py)."""
        if x.is_cuda:
            from nanovllm.kernels.activation import gelu_tanh_and_mul
            return gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On CUDA one Triton pass (kernels/activation.py); silu_and_mul above is its reference and the CPU path."""
        if x.is_cuda:
            from nanovllm.kernels.activation import silu_and_mul as triton_silu_and_mul
            return triton_silu_and_mul(x)
        return silu_and_mul(x)
