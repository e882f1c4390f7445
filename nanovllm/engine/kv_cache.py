"""The paged KV cache: how many blocks fit, and one tensor for every layer's K and V, bound to the layers."""
import logging

import torch

from nanovllm.engine.warmup import warmup
from nanovllm.layers.attention.fp8 import is_fp8

logger = logging.getLogger("nanovllm")


def block_bytes(runner) -> int:
    """Bytes of one block across all layers, K and V (and an fp8 cache's float32 scale per token and head)."""
    layer, dtype = runner.attn_layers[0], runner.config.kv_cache_torch_dtype
    row = layer.head_dim * dtype.itemsize + (4 if is_fp8(dtype) else 0)
    return 2 * len(runner.attn_layers) * runner.block_size * layer.num_kv_heads * row


def count_blocks(runner) -> int:
    """The configured count; else on CUDA what is left after a warm-up at the largest step, on CPU the budget.
    With tensor parallelism every rank must hold the same blocks: the smallest count wins."""
    cfg = runner.config
    if runner.is_cuda:
        warmup(runner)  # measures the activation peak, and compiles the largest step before the first real one
    if cfg.num_kvcache_blocks > 0:
        num_blocks = cfg.num_kvcache_blocks
    elif runner.is_cuda:
        num_blocks = _blocks_in_free_gpu_memory(runner)
    else:
        num_blocks = int(cfg.cpu_kvcache_gb * 2**30) // block_bytes(runner)
    if runner.group is not None:
        num_blocks = runner.group.min(num_blocks, runner.device)
    return num_blocks


def _blocks_in_free_gpu_memory(runner) -> int:
    """total × gpu_memory_utilization − used − (peak − current), in blocks, after the max-size warm-up."""
    cfg = runner.config
    free, total = torch.cuda.mem_get_info()
    used = total - free
    stats = torch.cuda.memory_stats()
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    available = int(total * cfg.gpu_memory_utilization - used - (peak - current))
    blocks = available // block_bytes(runner)
    if blocks <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB total, {used / 2**30:.1f} GiB in use, "
            f"{(peak - current) / 2**30:.1f} GiB activation peak; raise gpu_memory_utilization "
            f"(now {cfg.gpu_memory_utilization}) or lower max_num_batched_tokens / max_num_seqs")
    return blocks


def allocate(runner, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim] (and, for fp8, one of scales [2, layers,
    blocks, kv_heads, block_size]); each attention layer gets its K and V views. An fp8 V is stored token-major
    ([blocks, kv_heads, head_dim, block_size] per layer), viewed with K's indexing."""
    cfg = runner.config
    if num_blocks * runner.block_size < cfg.max_model_len:
        raise ValueError(
            f"the KV cache holds {max(num_blocks, 0)} blocks x {runner.block_size} tokens, fewer than "
            f"max_model_len={cfg.max_model_len}: lower max_model_len, or give the cache more room "
            "(num_kvcache_blocks, cpu_kvcache_gb on CPU, gpu_memory_utilization on GPU)")
    layer, dtype = runner.attn_layers[0], cfg.kv_cache_torch_dtype
    layers, bs, heads, dim = len(runner.attn_layers), runner.block_size, layer.num_kv_heads, layer.head_dim
    fp8 = is_fp8(dtype)
    # fp8: zeroed, so bytes never written are finite (the kernels read whole tiles of V past a context and give them
    # weight 0: NaN garbage would still poison the sum); scales start at 0 for the same reason
    kv_cache = (torch.zeros if fp8 else torch.empty)(2, layers, num_blocks, bs, heads, dim, dtype=dtype,
                                                     device=runner.device)
    kv_scale = torch.zeros(2, layers, num_blocks, heads, bs, dtype=torch.float32, device=runner.device) if fp8 else None
    for i, attn in enumerate(runner.attn_layers):
        v = kv_cache[1, i]
        if fp8:  # V token-major (layers/attention/fp8.py says why), indexed [blocks, block_size, heads, dim] as K
            v = v.view(num_blocks, heads, dim, bs).permute(0, 3, 1, 2)
        attn.bind(kv_cache[0, i], v, *((kv_scale[0, i], kv_scale[1, i]) if fp8 else ()))
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", num_blocks, runner.block_size,
                num_blocks * block_bytes(runner) / 2**30, cfg.kv_cache_dtype if fp8 else dtype)
    return kv_cache, kv_scale
