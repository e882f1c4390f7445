import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(first half) * second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
