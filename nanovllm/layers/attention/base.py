import itertools

import torch

from nanovllm.layers.attention.fp8 import is_fp8
from nanovllm.layers.context import Context, ToDevice, to_device_packed


class AttentionBackend:
    """What every attention implementation provides. Shapes:
    q [tokens, heads, head_dim]; k, v [tokens, kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]. Returns [tokens, heads, head_dim].
    An fp8 cache (layers/attention/fp8.py) comes with k_scale, v_scale [num_blocks, kv_heads, block_size] float32:
    stores quantize into it, and attention over cached K/V dequantizes; fresh k, v are used as they are.
    A layer may pass window (a query at position p sees keys p - window < key <= p: sliding-window layers) and
    softcap (scores s become softcap * tanh(s / softcap): Gemma 2) to prefill and decode.

    Each backend also builds its own per-step metadata (the Context) from the runner's host-side lists, and the
    static buffers a decode CUDA graph reads, so the runner and the graphs never name its fields.
    """

    name = "base"
    supports_cuda_graphs = True  # False: decode runs eagerly (the backend syncs with the host)
    supports_fp8_kv_cache = True

    def release(self):
        """Drop whatever the backend keeps between steps (sleep frees the KV cache: nothing may outlive it)."""

    def check_head_dim(self, head_dim: int):
        """Raise ValueError, once at start-up, for a head size this backend cannot run."""

    def check_kv_cache_dtype(self, dtype: torch.dtype):
        """Raise ValueError, once at start-up, for a cache type this backend cannot run."""
        if is_fp8(dtype) and not self.supports_fp8_kv_cache:
            raise ValueError(f"the {self.name} attention backend cannot read an fp8 KV cache; use "
                             "attention_backend='triton' or kv_cache_dtype='auto'")

    # ---- per-step metadata ------------------------------------------------------------------------
    def prefill_context(self, to_device: ToDevice, cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                        slot_mapping: list[int], block_tables: list[list[int]] | None) -> Context:
        """block_tables: one row per sequence, right-padded with -1; None when no sequence has cached history."""
        return Context(True, cu_seqlens_q=to_device(cu_seqlens_q, torch.int32),
                       cu_seqlens_k=to_device(cu_seqlens_k, torch.int32),
                       max_seqlen_q=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
                       max_seqlen_k=max(b - a for a, b in zip(cu_seqlens_k, cu_seqlens_k[1:])),
                       slot_mapping=to_device(slot_mapping, torch.int32) if slot_mapping else None,
                       block_tables=to_device(block_tables, torch.int32) if block_tables is not None else None)

    def decode_context(self, to_device: ToDevice, slot_mapping: list[int], context_lens: list[int],
                       block_tables: list[list[int]]) -> Context:
        """block_tables: one row per sequence, right-padded with -1. The three go in one copy."""
        slots, lens, tables = to_device_packed(to_device, [slot_mapping, context_lens,
                                                           list(itertools.chain.from_iterable(block_tables))],
                                               torch.int32)
        return Context(False, slot_mapping=slots, context_lens=lens,
                       block_tables=tables.view(len(block_tables), len(block_tables[0])))

    # ---- decode CUDA graphs -----------------------------------------------------------------------
    def graph_buffers(self, max_batch: int, max_blocks: int, device: torch.device) -> Context:
        """Static decode metadata that graphs are captured on; padding rows write nothing and read nothing."""
        return Context(False, slot_mapping=torch.full((max_batch,), -1, dtype=torch.int32, device=device),
                       context_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
                       block_tables=torch.full((max_batch, max_blocks), -1, dtype=torch.int32, device=device))

    def graph_view(self, buffers: Context, batch: int) -> Context:
        """The first `batch` rows of the buffers: what the graph of that bucket is captured on."""
        return Context(False, slot_mapping=buffers.slot_mapping[:batch], context_lens=buffers.context_lens[:batch],
                       block_tables=buffers.block_tables[:batch])

    def write_graph_step(self, views: dict, slot_mapping: list[int], context_lens: list[int],
                         block_tables: list[list[int]]):
        """A decode step's metadata into numpy views of a host image of the buffers (engine/cuda_graph.py,
        DecodeGraphs.stage), whose other rows and columns hold the buffers' initial values: rows past the step's
        batch are padding (write nothing, read nothing)."""
        n = len(slot_mapping)
        views["slot_mapping"][:n] = slot_mapping
        views["context_lens"][:n] = context_lens
        views["block_tables"][:n, :len(block_tables[0])] = block_tables

    # ---- the kernels --------------------------------------------------------------------------------
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None):
        """Write token t's K/V to slot slot_mapping[t] (block * block_size + offset); skip slot -1."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Causal attention over packed sequences; with context.block_tables, keys and values come
        from the cache (which already holds the new tokens) so cached history is included."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """One query per sequence over its first context_lens[s] cached tokens."""
        raise NotImplementedError
