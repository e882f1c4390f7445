import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.compile import compiled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> silu(first half) * second half."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = silu_and_mul

    def use_compiled(self, enabled: bool = True):
        self.fn = compiled(silu_and_mul) if enabled else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
