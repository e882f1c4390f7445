"""Linear layers at decode batch sizes: cuBLAS (F.linear) against the Triton kernel of kernels/gemv.py, on
the Qwen3-0.6B shapes (or Qwen3-8B's). CUDA-graph replays of one call per weight copy (copies rotated past the 50
MB L2, as 28 layers are), GB/s over the weight bytes, against the H200's 4,170 GB/s copy bandwidth.

    python benchmarks/small_gemm.py [--rows 1 4 16] [--sweep] [--swap] [--model 0.6b|8b] [--chain]

--chain: a decode step's linear part as the engine runs it, 28 layers of (qkv, o, norm, gate_up, SiLU-and-mul,
down, norm) + LM head, one CUDA graph: cuBLAS, the general Triton kernel, the one-row kernel without and with
programmatic dependent launch (kernels/pdl.py).
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from nanovllm.kernels import gemv  # noqa: E402

HBM_GBPS = 4170.0
# (name, N, K) of Qwen3-0.6B: qkv, o, gate_up, down, lm_head
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
          ("lm_head", 151936, 1024)]
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
             ("lm_head", 151936, 4096)]  # Qwen3-8B (--model 8b; 36 layers)


def time_graph(fn, calls: int) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3 / calls  # us


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep", action="store_true", help="also try other tiles and K splits")
    p.add_argument("--swap", action="store_true", help="also try the swapped product (y^T = W x^T, gemv.swapped) with "
                   "other tiles and K splits")
    p.add_argument("--model", choices=["0.6b", "8b"], default="0.6b",
                   help="the shapes of Qwen3-0.6B or Qwen3-8B (--chain: always 0.6B)")
    p.add_argument("--chain", action="store_true", help="only the layer chain of a decode step (see above)")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.chain:
        return chain(args.rows)
    total = {}
    for name, n, k in SHAPES_8B if args.model == "8b" else SHAPES:
        nbytes = n * k * 2
        copies = max(1, triton.cdiv(256 * 2**20, nbytes))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x.float(), ws[0].float())
            out = gemv.gemv(x, ws[0])
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, m, err)
            choices = [("cublas", None), ("default", None)]
            swap = gemv.swapped(m, n, k, x.device, x.dtype)
            base = gemv.gemv_config(m, n, k, swap)
            if m > 1:  # the default tile over 1-4 K-splits as launched (default: gemv_split_k's choice)
                launched = sorted({gemv.k_splits(k, s, base[1])[0] for s in (1, 2, 3, 4)})
                choices += [(f"split {s}", (*base, s, swap)) for s in launched]
                if swap:  # and the tile it replaces, with its default splits
                    choices.append(("unswapped", (*gemv.gemv_config(m, n, k), 0, False)))
            if args.swap and m > 1:
                for bk, st in ((128, 3), (128, 4), (256, 3), (256, 4)):
                    for s in sorted({gemv.k_splits(k, s, bk)[0] for s in (1, 2, 3, 4, 6, 8)}):
                        choices.append((f"swap {bk},{st},{s}", (gemv.SWAP_TILE[0], bk, 4, st, s, True)))
            if args.sweep:
                for bn, bk, w, st in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8), (2, 3, 4)):
                    if bn * bk <= 16384 and (m > 1 or bn <= 16) and (m == 1 or bn >= 16):
                        choices.append((f"{bn},{bk},{w},{st}", (bn, bk, w, st)))
            res = []
            for label, cfg in choices:
                if label == "cublas":
                    def fn(x=x, ws=ws):
                        for w in ws:
                            F.linear(x, w)
                else:
                    def fn(x=x, cfg=cfg, ws=ws):
                        for w in ws:
                            gemv.gemv(x, w, config=cfg)
                try:
                    us = time_graph(fn, copies)
                except Exception as e:  # a tile that does not compile
                    print(f"{name:8s} M={m:2d} {label:16s} {type(e).__name__}: {str(e)[:80]}")
                    continue
                res.append((label, us))
            splits = "  ".join(f"{label} {us:6.2f}" for label, us in res
                               if label.startswith(("split", "swap", "unswapped")))
            cublas, default = res[0][1], res[1][1]
            best = min(res[1:], key=lambda r: r[1])
            total.setdefault(m, [0.0, 0.0, 0.0])
            mult = (36 if args.model == "8b" else 28) if name != "lm_head" else 1
            for i, v in enumerate((cublas, default, best[1])):
                total[m][i] += mult * v
            gb = lambda us, nbytes=nbytes: nbytes / us / 1e3  # noqa: E731
            print(f"{name:8s} M={m:2d} cublas {cublas:7.2f} us ({gb(cublas):5.0f} GB/s)  triton default "
                  f"{default:7.2f} us ({gb(default):5.0f})  best {best[0]} {best[1]:7.2f} us ({gb(best[1]):5.0f}) "
                  f"cfg={base}{' swapped' if swap else ''} "
                  f"split_k={gemv.gemv_split_k(m, n, k, *base[:2], x.device, swap)}  {splits}", flush=True)
        del ws
        torch.cuda.empty_cache()
    print(f"\n== one decode step's linear layers ({36 if args.model == '8b' else 28} layers + lm_head), us ==")
    for m, (c, d, b) in total.items():
        print(f"M={m:2d}: cublas {c:8.1f}  triton default {d:8.1f}  best-per-shape {b:8.1f}")


def chain(rows_list):
    from nanovllm.kernels import activation, norm
    layers, hidden, inter, vocab = 28, 1024, 3072, 151936

    def weight(n, k):
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
    ws = [(weight(4096, hidden), weight(hidden, 2048), weight(2 * inter, hidden), weight(hidden, inter))
          for _ in range(layers)]
    head = weight(vocab, hidden)
    nw = torch.rand(hidden, dtype=torch.bfloat16, device="cuda") + 0.5

    def step(x, matmul):
        h, r = norm.rms_norm(x, nw, 1e-6), x
        for qkv, o, gu, down in ws:
            h = matmul(matmul(h, qkv)[:, :2048].contiguous(), o)
            h, r = norm.add_rms_norm(h, r, nw, 1e-6)
            h = matmul(activation.silu_and_mul(matmul(h, gu)), down)
            h, r = norm.add_rms_norm(h, r, nw, 1e-6)
        return matmul(h, head)

    def folded(x, pdl):  # one row: the norms, residual adds and SiLU inside the one-row kernel (forward_small)
        h, r = gemv.gemv_folded(x, ws[0][0], norm=(nw, 1e-6), pdl=pdl), x
        for i, (qkv, o, gu, down) in enumerate(ws):
            if i:
                h, r = gemv.gemv_folded(h, qkv, norm=(nw, 1e-6), residual=r, pdl=pdl)
            h = gemv.gemv(h[:, :2048].contiguous(), o, pdl=pdl)
            h, r = gemv.gemv_folded(h, gu, norm=(nw, 1e-6), residual=r, pdl=pdl)
            h = gemv.gemv_folded(h, down, gated=True, pdl=pdl)
        return gemv.gemv(norm.add_rms_norm(h, r, nw, 1e-6)[0], head, pdl=pdl)

    variants = [("cublas", F.linear),
                ("triton, general kernel", lambda a, w: gemv.gemv(a, w, row_kernel=False)),
                ("triton, one-row kernel", lambda a, w: gemv.gemv(a, w, pdl=False)),
                ("triton, one-row kernel + PDL", lambda a, w: gemv.gemv(a, w, pdl=True)),
                ("triton, default", gemv.gemv),
                ("one-row, folded", "folded"), ("one-row, folded + PDL", "folded+pdl")]
    nbytes = sum(w.numel() * 2 for layer in ws for w in layer) + head.numel() * 2
    for m in rows_list:
        x = torch.randn(m, hidden, dtype=torch.bfloat16, device="cuda")
        ref = None
        for label, matmul in variants:
            if m > 1 and "one-row" in label:  # (one row only)
                continue
            if isinstance(matmul, str):
                with_pdl = matmul.endswith("pdl")
                run = lambda x, pdl=with_pdl: folded(x, pdl)  # noqa: E731
            else:
                run = lambda x, matmul=matmul: step(x, matmul)  # noqa: E731
            out = run(x).float()
            ref = out if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            us = time_graph(lambda run=run, x=x: run(x), 1)
            print(f"M={m:2d} {label:30s} {us:8.1f} us/step ({nbytes / us / 1e3:5.0f} GB/s over the weights)  "
                  f"rel. diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
