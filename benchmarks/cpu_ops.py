"""The CPU path's two big costs, timed alone (2 torch threads unless --threads): one decode step's matmuls
(SmolLM2-135M shapes, 30 layers + LM head, weights rotated past L3) as layers/linear.linear does them against
oneDNN-packed weights (layers/cpu_weights.py); and the torch decode attention (32 sequences of 160-384 tokens,
9 query heads on 3 KV heads of 64) in one SDPA call against groups of 4, 8, 16 sequences of similar length.

    python benchmarks/cpu_ops.py [--rows 1 4 32 512] [--threads 2]

Times are the second best of seven repeats (a shared machine drifts)."""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.layers import cpu_weights  # noqa: E402
from nanovllm.layers.attention.torch_ref import TorchAttention  # noqa: E402
from nanovllm.layers.context import Context  # noqa: E402
from nanovllm.layers.linear import linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed(fn, inner: int = 3) -> float:
    fn()
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - start) / inner * 1000)
    return sorted(runs)[1]


def matmuls(rows_list: list[int]):
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    packed = [cpu_weights.pack_tensor(w) for w in weights]
    print("one decode step's matmuls, ms: rows, linear (dense), packed for oneDNN")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        dense = timed(lambda xs=xs: [linear(xs[w.shape[1]], w) for w in weights], 1 if rows > 64 else 3)
        onednn = timed(lambda xs=xs: [cpu_weights.linear(xs[w.shape[1]], p) for w, p in zip(weights, packed)],
                       1 if rows > 64 else 3)
        print(f"  {rows:5d}  {dense:9.1f}  {onednn:9.1f}")


def attention():
    random.seed(0)
    batch, kv_heads, group, dim, block = 32, 3, 3, 64, 256
    lens = [random.randint(160, 384) for _ in range(batch)]
    num_blocks = 200
    k_cache, v_cache = torch.randn(2, num_blocks, block, kv_heads, dim)
    perm, tables, start = random.sample(range(num_blocks), num_blocks), [], 0
    for n in lens:
        need = (n + block - 1) // block
        tables.append(perm[start:start + need] + [-1] * (2 - need))
        start += need
    context = Context(False, context_lens=torch.tensor(lens, dtype=torch.int32),
                      block_tables=torch.tensor(tables, dtype=torch.int32))
    q = torch.randn(batch, kv_heads * group, dim)
    print("decode attention per layer, ms: sequences per SDPA call")
    for size in (32, 16, 8, 4):
        backend = TorchAttention()
        backend.GROUP = size
        ms = timed(lambda backend=backend: backend.decode(q, k_cache, v_cache, context, dim ** -0.5), 10)
        print(f"  {size:3d}  {ms:6.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.threads < 1 or min(args.rows) < 1:
        p.error("--threads and every --rows value must be at least 1")
    torch.set_num_threads(args.threads)
    if cpu_weights.available():
        matmuls(args.rows)
    else:
        print("this torch has no oneDNN linear ops: matmuls skipped")
    attention()


if __name__ == "__main__":
    main()
