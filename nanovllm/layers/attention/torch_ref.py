"""Pure-torch attention over the paged KV cache: the CPU path and the reference for other backends."""
import torch
import torch.nn.functional as F

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.attention.fp8 import dequantize, quantize, raw
from nanovllm.utils.context import Context


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, kv_heads, head_dim] (dequantized to
    float32 when the cache is fp8, with its scales [num_blocks, kv_heads, block_size])."""
    block_size = cache.size(1)
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    rows = raw(cache)[blocks].flatten(0, 1)[:length].view(cache.dtype)
    return rows if scale is None else dequantize(rows, scale[blocks].transpose(1, 2).flatten(0, 1)[:length])


class TorchAttention(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False  # boolean-mask indexing in store_kvcache syncs with the host

    def __init__(self):
        # What every layer of a step shares (slots to write, rows to gather), computed by its first layer: keyed by
        # the step's tensor, so the next step (a new tensor) recomputes it.
        self._slots: tuple | None = None
        self._rows: tuple | None = None

    def _slots_for(self, slot_mapping: torch.Tensor):
        if self._slots is None or self._slots[0] is not slot_mapping:
            keep = slot_mapping >= 0
            self._slots = (slot_mapping, None if bool(keep.all()) else keep, slot_mapping[keep].long())
        return self._slots[1:]

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        keep, slots = self._slots_for(slot_mapping)
        for x, cache, x_scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            x = x if keep is None else x[keep]
            if x_scale is not None:
                x, s = quantize(x, cache.dtype)
                block_size = cache.size(1)
                x_scale[slots // block_size, :, slots % block_size] = s  # [tokens, kv_heads] into [.., heads, slot]
            if cache.is_contiguous():
                raw(cache).view(-1, *cache.shape[2:])[slots] = raw(x)
            else:  # an fp8 V, stored token-major
                raw(cache)[slots // cache.size(1), slots % cache.size(1)] = raw(x)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None):
        out = torch.empty_like(q)
        cu_q, cu_k = context.cu_seqlens_q.tolist(), context.cu_seqlens_k.tolist()
        for s in range(len(cu_q) - 1):
            q0, q1 = cu_q[s], cu_q[s + 1]
            len_q, len_k = q1 - q0, cu_k[s + 1] - cu_k[s]
            if context.block_tables is not None:
                ks = gather_kv(k_cache, context.block_tables[s], len_k, k_scale).to(q.dtype)
                vs = gather_kv(v_cache, context.block_tables[s], len_k, v_scale).to(q.dtype)
            else:
                ks, vs = k[q0:q1], v[q0:q1]
            # query i sits at position len_k - len_q + i and sees keys up to there
            rows = torch.arange(len_q, device=q.device).unsqueeze(1) + (len_k - len_q)
            mask = torch.arange(len_k, device=q.device).unsqueeze(0) <= rows
            # The query heads of one KV head become rows of one attention (head h = kv_head * group + g), and the
            # inputs are 4-D: so SDPA runs its fused CPU kernel (with enable_gqa, or 3-D inputs, and a mask it
            # takes the math path, several times slower).
            heads, kv_heads, head_dim = q.size(1), ks.size(1), q.size(2)
            group = heads // kv_heads
            qs = q[q0:q1].transpose(0, 1).reshape(1, kv_heads, group * len_q, head_dim)
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                               attn_mask=mask.repeat(group, 1), scale=scale)
            out[q0:q1] = o.reshape(heads, len_q, head_dim).transpose(0, 1)  # (SDPA's output may be strided)
        return out

    def _rows_for(self, context: Context, block_size: int):
        """(blocks, offsets [batch, length] of the cache rows to gather, the same as flat row ids [batch * length],
        valid [batch, length]) for a decode step."""
        if self._rows is None or self._rows[0] is not context.context_lens or self._rows[1] is not context.block_tables:
            lens = context.context_lens.long()
            length = int(lens.max()) if lens.numel() else 0
            steps = torch.arange(length, device=lens.device).unsqueeze(0)
            pos = torch.minimum(steps, (lens - 1).clamp(min=0).unsqueeze(1))
            blocks = context.block_tables.long().gather(1, pos // block_size).clamp(min=0)
            offsets = pos % block_size
            self._rows = (context.context_lens, context.block_tables, blocks, offsets,
                          (blocks * block_size + offsets).flatten(), steps < lens.unsqueeze(1))
        return self._rows[2:]

    def decode(self, q, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None):
        """Gathers each sequence's tokens up to the batch's longest context (not whole blocks), then one SDPA.
        Positions past a sequence's own context read its last real token, so they hold finite values (the cache
        past a sequence can hold anything, NaN too) and the mask gives them no weight."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.size(2)
        blocks, offsets, flat, valid = self._rows_for(context, k_cache.size(1))

        def rows(cache: torch.Tensor) -> torch.Tensor:  # [batch, length, kv_heads, head_dim]
            if cache.is_contiguous():  # index_select over whole rows: about 7x faster on CPU than the 2-D index
                rows = raw(cache).view(-1, *cache.shape[2:]).index_select(0, flat)
                return rows.view(*blocks.shape, *cache.shape[2:]).view(cache.dtype)
            return raw(cache)[blocks, offsets].view(cache.dtype)  # (an fp8 V, stored token-major)
        k, v = rows(k_cache), rows(v_cache)
        if k_scale is not None:
            k = dequantize(k, k_scale[blocks, :, offsets])
            v = dequantize(v, v_scale[blocks, :, offsets])
        out = F.scaled_dot_product_attention(q.unsqueeze(2).float(), k.transpose(1, 2).float(),
                                             v.transpose(1, 2).float(), attn_mask=valid[:, None, None, :],
                                             scale=scale, enable_gqa=num_heads != num_kv_heads)
        # a context of 0 (no key at all) gives NaN rows: zeros, as the kernels write
        return out.squeeze(2).nan_to_num(0.0).to(q.dtype)
