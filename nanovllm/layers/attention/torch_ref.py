"""Pure-torch attention over the paged KV cache: the CPU path and the reference for other backends.

A sliding window (a query at position p sees keys p - window < key <= p) is a mask; soft-capped logits (Gemma 2:
cap * tanh(s / cap)) need the scores themselves, so those layers take `_sdpa`'s explicit path."""
import math

import torch
import torch.nn.functional as F

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.attention.fp8 import dequantize, quantize, raw
from nanovllm.layers.context import Context


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float | None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, or with softcap the same product written out: scores * scale, capped, the
    mask (True: attend), softmax in float32."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v.float()).to(q.dtype)


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
        self._buffers: list[torch.Tensor | None] = [None, None]

    def release(self):
        self._slots = self._rows = None
        self._buffers = [None, None]

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

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None, window=None,
                softcap=None):
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
            if len_q == len_k and not window:  # no history: causal from the top left; without a mask SDPA's fused
                # CPU kernel takes enable_gqa and skips the masked half
                o = _sdpa(q[q0:q1].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], None,
                          scale, softcap, is_causal=True, enable_gqa=q.size(1) != ks.size(1))
                out[q0:q1] = o[0].transpose(0, 1)
                continue
            # query i sits at position len_k - len_q + i and sees keys up to there (and, with a window, after
            # that minus the window)
            rows = torch.arange(len_q, device=q.device).unsqueeze(1) + (len_k - len_q)
            keys = torch.arange(len_k, device=q.device).unsqueeze(0)
            mask = keys <= rows
            if window:
                mask &= keys > rows - window
            # The query heads of one KV head become rows of one attention (head h = kv_head * group + g), and the
            # inputs are 4-D: so SDPA runs its fused CPU kernel (with enable_gqa, or 3-D inputs, and a mask it
            # takes the math path, several times slower).
            heads, kv_heads, head_dim = q.size(1), ks.size(1), q.size(2)
            group = heads // kv_heads
            qs = q[q0:q1].transpose(0, 1).reshape(1, kv_heads, group * len_q, head_dim)
            o = _sdpa(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], mask.repeat(group, 1), scale, softcap)
            out[q0:q1] = o.reshape(heads, len_q, head_dim).transpose(0, 1)  # (SDPA's output may be strided)
        return out

    GROUP = 8  # decode sequences per SDPA call, in context-length order (padding to a group's longest, not the batch's)

    def _groups_for(self, context: Context, block_size: int) -> list[tuple]:
        """Per group of up to GROUP sequences of similar context length: (sequence ids [n], blocks and offsets
        [n, length] of the cache rows to gather, the same as flat row ids [n * length], valid [n, 1, 1, length]
        (None for one sequence: no padding), the first row when they are one run of the cache, else None).
        Grouping by length saves more padding reads than its extra calls cost (docs/kernels.md)."""
        if self._rows is None or self._rows[0] is not context.context_lens or self._rows[1] is not context.block_tables:
            lens = context.context_lens.long()
            order = torch.argsort(lens, stable=True)
            sorted_lens = lens[order].tolist()  # one read of the lengths for every group (on CUDA: one sync)
            groups = []
            for i, ids in enumerate(order.split(self.GROUP)):
                g_lens = lens[ids]
                last = min(len(sorted_lens), (i + 1) * self.GROUP) - 1  # sorted: a group's last is its longest
                length = sorted_lens[last] if last >= 0 else 0  # (an empty batch splits into one empty group)
                steps = torch.arange(length, device=lens.device).unsqueeze(0)
                pos = torch.minimum(steps, (g_lens - 1).clamp(min=0).unsqueeze(1))
                blocks = context.block_tables[ids].long().gather(1, pos // block_size).clamp(min=0)
                offsets = pos % block_size
                start = None  # one sequence in consecutive blocks: its rows are a slice of the cache, no gather
                if ids.numel() == 1 and length:  # (batch 1, the notebook case; and a batch's odd one out)
                    table = context.block_tables[ids[0], : (length + block_size - 1) // block_size].long()
                    if torch.equal(table, table[0] + torch.arange(table.numel(), device=table.device)):
                        start = int(table[0]) * block_size
                valid = None if ids.numel() == 1 and length else (steps < g_lens.unsqueeze(1))[:, None, None, :]
                groups.append((ids, blocks, offsets, (blocks * block_size + offsets).flatten(), valid, start))
            self._rows = (context.context_lens, context.block_tables, groups)
        return self._rows[2]

    def _buffer(self, which: int, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """A gather destination reused by every layer and group (one for K, one for V): allocating them per call
        makes the allocator map and fault in fresh pages each time, which costs more than the gather itself, and
        more as the process ages. A quarter of headroom, as contexts grow by a token a step."""
        numel = math.prod(shape)
        buf = self._buffers[which]
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[which] = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, flat: torch.Tensor,
                buffer: int, start: int | None = None) -> torch.Tensor:
        """The rows [n, length, kv_heads, head_dim] a group reads (`start`: they are the cache's rows from there)."""
        if not cache.is_contiguous():  # an fp8 V, stored token-major
            return raw(cache)[blocks, offsets].view(cache.dtype)
        src = raw(cache).view(-1, *cache.shape[2:])
        if start is not None:  # a slice, no copy (far cheaper than a gather at batch 1)
            rows = src[start : start + flat.numel()]
        else:  # index_select over whole rows: about 7x faster on CPU than the 2-D index
            rows = torch.index_select(src, 0, flat, out=self._buffer(buffer, (flat.numel(), *src.shape[1:]), src))
        return rows.view(*blocks.shape, *cache.shape[2:]).view(cache.dtype)

    def decode(self, q, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None, window=None,
               softcap=None):
        """Per group of sequences of similar length (_groups_for): gathers each sequence's tokens up to the group's
        longest context (not whole blocks), then one SDPA with a KV head's query heads as its rows (4-D inputs,
        no enable_gqa: torch's fused CPU kernel). Positions past a sequence's own context read its last real token,
        so they hold finite values (the cache past a sequence can hold anything, NaN too) and the mask gives them
        no weight."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.size(2)
        group = num_heads // num_kv_heads
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
        for ids, blocks, offsets, flat, valid, start in self._groups_for(context, k_cache.size(1)):
            n, length = blocks.shape
            k = self._gather(k_cache, blocks, offsets, flat, 0, start)
            v = self._gather(v_cache, blocks, offsets, flat, 1, start)
            if k_scale is not None:
                k = dequantize(k, k_scale[blocks, :, offsets])
                v = dequantize(v, v_scale[blocks, :, offsets])
            qs = q[ids].view(n, num_kv_heads, group, head_dim).float()
            if window:  # only each sequence's last `window` keys
                keys = torch.arange(length, device=q.device)
                recent = (keys >= (context.context_lens[ids].long() - window).unsqueeze(1))[:, None, None, :]
                valid = recent if valid is None else valid & recent
            o = _sdpa(qs, k.transpose(1, 2).float(), v.transpose(1, 2).float(), valid, scale, softcap)
            out[ids] = o.reshape(n, num_heads, head_dim)
        # a context of 0 (no key at all) gives NaN rows: zeros, as the kernels write
        return out.nan_to_num_(0.0).to(q.dtype)
