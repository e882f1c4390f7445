"""Attention: one module, pluggable backends chosen by name."""
import importlib.util

import torch
from torch import nn

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.context import get_context

BACKENDS = ("torch", "triton", "flash_attn")


def get_backend(name: str, device: str, fp8_kv_cache: bool = False) -> AttentionBackend:
    """'auto' picks flash_attn when importable on CUDA (and the cache is 16-bit), else our Triton kernels; torch
    on CPU."""
    if name == "auto":
        if device != "cuda":
            name = "torch"
        else:
            name = "flash_attn" if importlib.util.find_spec("flash_attn") and not fp8_kv_cache else "triton"
    if name == "torch":
        from nanovllm.layers.attention.torch_ref import TorchAttention
        return TorchAttention()
    if name == "triton":
        from nanovllm.layers.attention.triton_backend import TritonAttention
        return TritonAttention()
    if name == "flash_attn":
        from nanovllm.layers.attention.flash_attn_backend import FlashAttention
        return FlashAttention()
    raise ValueError(f"unknown attention backend {name!r}; valid: auto, {', '.join(BACKENDS)}")


class Attention(nn.Module):
    """Stores the new K/V in this layer's cache slice, then attends. The model runner binds the cache (`bind`)
    and the backend after the KV cache is allocated."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, window: int | None = None,
                 softcap: float | None = None):
        """window: this layer attends to the last `window` keys only (sliding-window layers); softcap: its scores
        are soft-capped (cap * tanh(s / cap))."""
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.window, self.softcap = window, softcap
        # (passed to the backend only when set: a backend without them still serves every other model)
        self.options = {k: v for k, v in (("window", window), ("softcap", softcap)) if v}
        self.k_cache = self.v_cache = torch.tensor([])
        self.scales: dict[str, torch.Tensor] = {}  # an fp8 cache: k_scale and v_scale [blocks, kv_heads, block_size]
        self.backend: AttentionBackend | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scales = {"k_scale": k_scale, "v_scale": v_scale} if k_scale is not None else {}

    def store_target(self) -> tuple[torch.Tensor, ...] | None:
        """(k_cache, v_cache, slot_mapping[, k_scale, v_scale]) when the q/k rotary kernel may write this step's K/V
        itself (kernels/rope.py, Triton backend: a 16-bit cache, or an fp8 one in decode steps, whose scattered
        slots store_kvcache writes byte by byte too), else None."""
        context = get_context()
        if (self.k_cache.numel() and context.slot_mapping is not None and self.backend is not None
                and self.backend.name == "triton" and not (self.scales and context.is_prefill)):
            return self.k_cache, self.v_cache, context.slot_mapping, *self.scales.values()
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False) -> torch.Tensor:
        """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]. stored:
        the new K/V are already in the cache (store_target)."""
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if not stored and k_cache.numel() and context.slot_mapping is not None:
            self.backend.store_kvcache(k, v, k_cache, v_cache, context.slot_mapping, **self.scales)
        if context.is_prefill:
            return self.backend.prefill(q, k, v, k_cache, v_cache, context, self.scale, **self.scales, **self.options)
        return self.backend.decode(q, k_cache, v_cache, context, self.scale, **self.scales, **self.options)
