"""Tile choices for the decode kernel at one shape: CUDA-graph replays, GB/s over the bytes read.

    python benchmarks/decode_tiles.py [--kv-cache-dtype fp8] [--batch 256] [--context 1024]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm.config import KV_CACHE_DTYPES  # noqa: E402
from nanovllm.layers.attention.fp8 import cache_layout, quantize  # noqa: E402
from nanovllm.layers.kernels.decode import decode_attention, num_decode_splits  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--kv-cache-dtype", default="fp8")
p.add_argument("--batch", type=int, default=256)
p.add_argument("--context", type=int, default=1024)
args = p.parse_args()
heads, kv_heads, head_dim, block_size = 16, 8, 128, 256
kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
blocks = args.batch * triton.cdiv(args.context, block_size)
copies = 4
kv = torch.randn(2, copies * blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
scales = {}
if kv_dtype is not None:
    kv, s = quantize(kv, kv_dtype)
    s = cache_layout(s)
    scales = dict(k_scale=s[0], v_scale=s[1])
row = head_dim * kv.element_size() + (4 if kv_dtype is not None else 0)
nbytes = args.batch * args.context * kv_heads * row * 2
q = torch.randn(args.batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
tables = torch.randperm(copies * blocks, device="cuda").to(torch.int32).view(copies, args.batch, -1)
splits = num_decode_splits(args.batch, kv_heads, tables.size(2) * block_size, q.device)
for config in [None, (32, 2, 3), (64, 2, 3), (64, 2, 4), (64, 4, 3), (128, 2, 3), (128, 4, 3)]:
    def run(config=config):
        for c in range(copies):
            decode_attention(q, kv[0], kv[1], lens, tables[c], head_dim ** -0.5, num_splits=splits, config=config,
                             **scales)
    try:
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / copies
        print(f"{args.kv_cache_dtype} b={args.batch} ctx={args.context} splits={splits} config={config}: "
              f"{ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s")
    except Exception as e:  # a tile that does not fit
        print(f"config={config}: {type(e).__name__}: {str(e)[:100]}")
