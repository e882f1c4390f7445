import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(orig_dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual): one pass instead of two."""
        if residual is None:
            return self._norm(x)
        x = (x.float() + residual.float()).to(x.dtype)
        return self._norm(x), x
