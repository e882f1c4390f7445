"""Attention through our Triton kernels (nanovllm/kernels): paged KV, split-K decode."""
import torch

from nanovllm.kernels.decode import decode_attention
from nanovllm.kernels.prefill import prefill_attention
from nanovllm.kernels.store_kvcache import store_kvcache
from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.context import Context


class TritonAttention(AttentionBackend):
    name = "triton"

    def check_head_dim(self, head_dim: int):
        if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
            raise ValueError(f"the triton attention backend needs head_dim a power of two in [16, 256], got "
                             f"{head_dim}; use attention_backend='torch'")

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None, window=None,
                softcap=None):
        if context.block_tables is not None:  # keys/values (history + new tokens) come from the cache
            k, v = k_cache, v_cache
        return prefill_attention(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k, context.max_seqlen_q, scale,
                                 context.block_tables, k_scale, v_scale, window, softcap)

    def decode(self, q: torch.Tensor, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None,
               window=None, softcap=None):
        # Grid from shapes only (CUDA graphs): the table width bounds every context length.
        max_context_len = context.block_tables.size(1) * k_cache.size(1)
        return decode_attention(q, k_cache, v_cache, context.context_lens, context.block_tables, scale,
                                max_context_len, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap)
