import torch

from nanovllm.utils.context import Context


class AttentionBackend:
    """What every attention implementation provides. Shapes:
    q [tokens, heads, head_dim]; k, v [tokens, kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]. Returns [tokens, heads, head_dim].
    """

    name = "base"
    supports_cuda_graphs = True  # False: decode runs eagerly (the backend syncs with the host)

    def check_head_dim(self, head_dim: int):
        """Raise ValueError, once at start-up, for a head size this backend cannot run."""

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor):
        """Write token t's K/V to slot slot_mapping[t] (block * block_size + offset); skip slot -1."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor:
        """Causal attention over packed sequences; with context.block_tables, keys and values come
        from the cache (which already holds the new tokens) so cached history is included."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context,
               scale: float) -> torch.Tensor:
        """One query per sequence over its first context_lens[s] cached tokens."""
        raise NotImplementedError
