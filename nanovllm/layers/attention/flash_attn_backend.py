"""Attention through the flash-attn package (optional dependency); K/V stores use our Triton kernel."""
import torch

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.context import Context

PAGED_BLOCK_MULTIPLE = 256  # flash-attn's paged KV wants block_size % 256 == 0


def _check_paged_block_size(k_cache: torch.Tensor):
    block_size = k_cache.size(1)
    if block_size % PAGED_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn reads a paged KV cache only with block sizes divisible by "
                         f"{PAGED_BLOCK_MULTIPLE}, got kvcache_block_size={block_size}: use kvcache_block_size=256 "
                         "or attention_backend='triton'")


class FlashAttention(AttentionBackend):
    name = "flash_attn"
    supports_fp8_kv_cache = False  # flash-attn reads 16-bit caches only

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise ImportError("attention_backend='flash_attn' needs the flash-attn package: pip install flash-attn "
                              "(or use attention_backend='triton')") from e
        from nanovllm.kernels.store_kvcache import store_kvcache
        self._varlen, self._with_kvcache, self._store = flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        self._store(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale, window=None, softcap=None):
        if context.block_tables is not None:  # history + new tokens are all in the cache
            _check_paged_block_size(k_cache)
            k, v = k_cache, v_cache
        return self._varlen(q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
                            max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
                            softmax_scale=scale, causal=True, block_table=context.block_tables,
                            **_window_softcap(window, softcap))

    def decode(self, q, k_cache, v_cache, context: Context, scale, window=None, softcap=None):
        _check_paged_block_size(k_cache)
        # q [batch, heads, head_dim] -> one query per sequence: [batch, 1, heads, head_dim]
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context.context_lens,
                                 block_table=context.block_tables, softmax_scale=scale, causal=True,
                                 **_window_softcap(window, softcap))
        return out.squeeze(1)


def _window_softcap(window: int | None, softcap: float | None) -> dict:
    """flash-attn's arguments for a window (window_size=(left, right): the keys around the query, so a window of W
    keys ending at the query is W - 1 to its left) and a soft-cap, each only when set (flash-attn before 2.6 has no
    softcap argument: a model without one must not pass it)."""
    options = {}
    if window:
        options["window_size"] = (window - 1, 0)
    if softcap:
        options["softcap"] = softcap
    return options
