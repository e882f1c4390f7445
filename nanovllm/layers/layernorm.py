import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize the last dimension in float32, as transformers does, then scale."""
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(orig_dtype) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add fused into the norm's pass."""
    x = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.norm_fn, self.add_norm_fn = rms_norm, add_rms_norm

    def use_compiled(self, enabled: bool = True):
        """On CUDA: one Triton kernel per call (layers/kernels/norm.py); this module's functions are the reference."""
        if enabled:
            from nanovllm.layers.kernels import norm
            self.norm_fn, self.add_norm_fn = norm.rms_norm, norm.add_rms_norm
        else:
            self.norm_fn, self.add_norm_fn = rms_norm, add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual)."""
        if residual is None:
            return self.norm_fn(x, self.weight, self.eps)
        return self.add_norm_fn(x, residual, self.weight, self.eps)
