"""The decode kernel's tile and split choices on Qwen3-0.6B attention shapes: CUDA-graph replays, GB/s over the
bytes it must read (K and V, plus the fp8 scales), against the H200's 4,170 GB/s copy bandwidth.

    python benchmarks/decode_tiles.py [--kv-cache-dtype auto fp8] [--shapes 256x1024 256xbench ...] [--quick]
    python benchmarks/decode_tiles.py --once --kv-cache-dtype fp8 --shapes 256xbench --configs 64,2,3
        (one plain launch per choice, for ncu)

A shape is BATCHxCONTEXT, or BATCHxbench: contexts uniform in [200, 2048] (seed 0), the mix a bench.py decode step
sees. The block tables are as wide as max_model_len 4096 allows (what the engine's decode graphs are captured
with), so the split heuristic sees the same bound as in the engine. Every choice is first checked against the
torch reference on the first shape.
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm.config import KV_CACHE_DTYPES  # noqa: E402
from nanovllm.kernels import decode  # noqa: E402
from nanovllm.layers.attention.fp8 import cache_layout, quantize, token_major  # noqa: E402
from nanovllm.layers.attention.torch_ref import TorchAttention  # noqa: E402
from nanovllm.layers.context import Context  # noqa: E402

HBM_GBPS = 4170.0
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN = 16, 8, 128, 256, 4096
COPIES = 4  # KV copies rotated so small cases are not served from L2


def contexts_for(shape: str) -> list[int]:
    batch, ctx = shape.split("x")
    if ctx == "bench":
        rng = random.Random(0)
        return [rng.randint(200, 2048) for _ in range(int(batch))]
    return [int(ctx)] * int(batch)


def make_case(lens: list[int], kv_dtype, v_layout: str):
    need = [triton.cdiv(n, BLOCK_SIZE) for n in lens]
    pool = COPIES * sum(need)
    kv = torch.randn(2, pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    scales = {}
    if kv_dtype is not None:
        kv, s = quantize(kv, kv_dtype)
        s = cache_layout(s)
        scales = dict(k_scale=s[0], v_scale=s[1])
    width = MAX_MODEL_LEN // BLOCK_SIZE
    perm = torch.randperm(pool).tolist()
    tables = torch.full((COPIES, len(lens), width), -1, dtype=torch.int32)
    at = 0
    for c in range(COPIES):
        for s, n in enumerate(need):
            tables[c, s, :n] = torch.tensor(perm[at:at + n])
            at += n
    if v_layout == "token":
        kv = (kv[0], token_major(kv[1]))
    q = torch.randn(len(lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    row = HEAD_DIM * kv[0].element_size() + (4 if kv_dtype is not None else 0)
    nbytes = sum(lens) * KV_HEADS * row * 2
    return q, kv, scales, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), nbytes


def old_equal_splits(batch: int) -> int:
    """The heuristic before fixed-length splits: one run per program, count from the batch size alone."""
    want = decode.PROGRAMS_PER_SM * decode.sm_count(torch.device("cuda")) // (batch * KV_HEADS)
    return max(1, min(want, MAX_MODEL_LEN // decode.MIN_TOKENS_PER_SPLIT, decode.MAX_SPLITS))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "fp8"])
    p.add_argument("--shapes", nargs="+", default=["256x1024", "256xbench", "128xbench", "64xbench", "16xbench",
                                                   "1x4096"])
    p.add_argument("--configs", nargs="+", default=None, help="BLOCK_N,warps,stages[,max_split_tokens|eq] ...")
    p.add_argument("--once", action="store_true", help="one plain launch per choice (for ncu), no timing")
    p.add_argument("--v-layout", choices=["d", "token"], default=None,
                   help="d: V stored like K (the 16-bit layout); token: each head's tokens contiguous (default: fp8 "
                        "token-major, 16-bit d, as the engine stores them)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.configs:
        choices = [tuple(c.split(",")) for c in args.configs]
    else:  # the default (None), equal runs as before, fixed-length splits of several lengths, other tiles
        choices = [("default",), ("default", "eq")] + [("default", str(t)) for t in (256, 1024, 4096)]
        choices += [(bn, w, st) for bn in ("64", "128") for w in ("2", "4", "8") for st in ("2", "3", "4")]
        choices += [("256", "4", "2"), ("256", "8", "2"), ("32", "2", "3"), ("32", "4", "4")]
    rows = []
    if not args.once:  # clocks up before the first timing (the first choice of a run read slower than later ones)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
        del a
    for name in args.kv_cache_dtype:
        kv_dtype = KV_CACHE_DTYPES[name]
        for si, shape in enumerate(args.shapes):
            lens = contexts_for(shape)
            layout = args.v_layout or ("token" if kv_dtype is not None else "d")
            q, kv, scales, tables, ctx_lens, nbytes = make_case(lens, kv_dtype, layout)
            ref = ref_scale = None
            for choice in choices:
                config = None if choice[0] == "default" else tuple(int(x) for x in choice[:3])
                rest = choice[3 if config else 1] if len(choice) > (3 if config else 1) else None
                extra = dict(config=config, max_context_len=MAX_MODEL_LEN, **scales)
                if rest == "eq":
                    extra["num_splits"] = old_equal_splits(len(lens))
                elif rest is not None:
                    extra["max_split_tokens"] = int(rest)
                label = f"{choice}"

                def run(extra=extra, q=q, kv=kv, ctx_lens=ctx_lens, tables=tables):
                    for c in range(COPIES):
                        decode.decode_attention(q, kv[0], kv[1], ctx_lens, tables[c], HEAD_DIM ** -0.5, **extra)
                try:
                    if args.once:
                        run()
                        torch.cuda.synchronize()
                        continue
                    if si == 0:  # check against the reference once per choice
                        out = decode.decode_attention(q, kv[0], kv[1], ctx_lens, tables[0], HEAD_DIM ** -0.5, **extra)
                        if ref is None:
                            context = Context(False, context_lens=ctx_lens, block_tables=tables[0])
                            ref = TorchAttention().decode(q.float(), kv[0] if kv_dtype else kv[0].float(),
                                                          kv[1] if kv_dtype else kv[1].float(), context,
                                                          HEAD_DIM ** -0.5, **scales)
                            ref_scale = ref.norm()
                        err = ((out.float() - ref).norm() / ref_scale).item()
                        if not err < 2e-2:
                            raise RuntimeError(f"wrong result: relative error {err:.3g}")
                    run()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    ms = triton.testing.do_bench(graph.replay, warmup=5 if args.quick else 10,
                                                 rep=30 if args.quick else 80, return_mode="median") / COPIES
                    gbps = nbytes / ms / 1e6
                    rows.append((name, shape, label, ms * 1e3, gbps))
                    print(f"{name:5s} {shape:10s} {label:28s} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s "
                          f"{100 * gbps / HBM_GBPS:5.1f}%", flush=True)
                except Exception as e:  # a tile that does not fit, or a wrong one
                    print(f"{name:5s} {shape:10s} {label:28s} {type(e).__name__}: {str(e)[:120]}", flush=True)
            del kv, scales
            torch.cuda.empty_cache()
    if rows:
        print("\n== best per dtype and shape (default first) ==")
        for name in args.kv_cache_dtype:
            for shape in args.shapes:
                mine = [r for r in rows if r[0] == name and r[1] == shape]
                if not mine:
                    continue
                best = min(mine, key=lambda r: r[3])
                print(f"{name:5s} {shape:10s} default {mine[0][3]:7.1f} us ({100 * mine[0][4] / HBM_GBPS:4.1f}%)  "
                      f"best {best[2]} {best[3]:7.1f} us ({100 * best[4] / HBM_GBPS:4.1f}%)")


if __name__ == "__main__":
    main()
