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


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the normalized x times (1 + weight), both in float32, then rounded."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: bool = False):
        """offset: Gemma's norm (offset_rms_norm), whose checkpoints store weight - 1."""
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual). On CUDA one Triton kernel
        (kernels/norm.py); the functions above are its reference and the CPU path."""
        if self.offset and residual is not None:  # (Gemma's layers carry no residual into a norm)
            raise ValueError("an offset RMSNorm takes no residual")
        if x.is_cuda:
            from nanovllm.kernels import norm
            fn, add_fn, offset_fn = norm.rms_norm, norm.add_rms_norm, norm.offset_rms_norm
        else:
            fn, add_fn, offset_fn = rms_norm, add_rms_norm, offset_rms_norm
        if self.offset:
            return offset_fn(x, self.weight, self.eps)
        return fn(x, self.weight, self.eps) if residual is None else add_fn(x, residual, self.weight, self.eps)
