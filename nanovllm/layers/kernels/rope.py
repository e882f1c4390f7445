"""Rotary embedding (neox style, the whole head) of q and k in place, with Qwen3's per-head q/k RMSNorm before it:
one program per token for all its q and k heads, instead of a chain of compiled kernels (norm q, norm k, rotate
q, rotate k) that each re-read the heads. Used by the decoder on CUDA (layers/rotary_embedding.py is the torch
reference, layers/layernorm.py's rms_norm the norm's)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, w_ptr, stride_t, stride_h, token, num_heads, cos, sin, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    ptr = x_ptr + token.to(tl.int64) * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF]: the first half of each head
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # in float32 up to the one final rounding: the eager path rounds the normed heads to 16 bits before
        # rotating them, and the rotation's cancellation can turn that into a large error on a small output (a
        # double-rounding variant missed the float32 reference by 0.024 on one of 16.7M bf16 elements, an H200)
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = x1 * inv * tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        x2 = x2 * inv * tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, positions_ptr, cache_ptr, q_w_ptr, k_w_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
                         slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
                         stride_cb, stride_cs, stride_ch, num_q_heads, num_k_heads, eps,
                         NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
                         STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d)[None, :]  # the cache rows are [cos | sin], float32
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d)[None, :]
    _rotate_heads(q_ptr, q_w_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, eps, NORM, BLOCK_HQ, HALF)
    k1, k2 = _rotate_heads(k_ptr, k_w_ptr, stride_kt, stride_kh, token, num_k_heads, cos, sin, eps, NORM, BLOCK_HK,
                           HALF)
    if STORE:  # the token's K and V rows into a 16-bit paged cache, as store_kvcache.py would (slot -1: skip)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            mask = (offs_h < num_k_heads)[:, None]
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h[:, None] * stride_ch \
                + offs_d[None, :]
            tl.store(k_cache_ptr + row, k1, mask=mask)
            tl.store(k_cache_ptr + row + HALF, k2, mask=mask)
            v = v_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            tl.store(v_cache_ptr + row, tl.load(v, mask=mask, other=0.0), mask=mask)
            tl.store(v_cache_ptr + row + HALF, tl.load(v + HALF, mask=mask, other=0.0), mask=mask)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (views of the qkv projection are fine: the
    last dimension must be contiguous); positions [tokens] int64; cos_sin_cache [max_position, head_dim] float32.
    With q_weight/k_weight, each head is RMS-normalized (eps) and scaled first. Writes q and k in place and
    returns them. store=(v, k_cache, v_cache, slot_mapping): also writes each token's rotated K and its V into a
    16-bit paged cache [num_blocks, block_size, kv_heads, head_dim] (both caches with the same strides) at its
    slot, as store_kvcache does: one kernel fewer per layer."""
    tokens, num_q_heads, head_dim = q.shape
    if tokens == 0:
        return q, k
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0 and cos_sin_cache.stride(-1) == 1
    norm = q_weight is not None
    v, k_cache, v_cache, slots = store if store is not None else (k, k, k, positions)
    if store is not None and not (v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
                                  and k_cache.stride(-1) == 1 and slots.numel() == tokens):
        raise ValueError("qk_norm_rope_(store=...) takes unit-stride V rows, two caches of one layout and a slot "
                         "per token")
    _qk_norm_rope_kernel[(tokens,)](
        q, k, positions, cos_sin_cache, q_weight if norm else q, k_weight if norm else k, v, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1) if store is not None else 0, k_cache.stride(2) if store is not None
        else 0, num_q_heads, k.size(1), eps,
        NORM=norm, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.size(1)),
        HALF=head_dim // 2, STORE=store is not None, BLOCK_SIZE=k_cache.size(1) if store is not None else 1,
        num_warps=4,
    )
    return q, k
