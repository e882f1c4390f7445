"""Write new K/V rows into the paged cache: one program per token, all kv heads at once."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch,
                          num_kv_heads,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # -1: this token's K/V must not be written
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # int64 slot arithmetic: one layer's cache can exceed 2**31 elements
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h[:, None] * stride_ch \
        + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim];
    slot_mapping [tokens] int32 (block * block_size + offset, -1 = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "K and V caches share one layout"
    assert slot_mapping.numel() == num_tokens and slot_mapping.is_contiguous()
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.size(1), BLOCK_H=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
    )
