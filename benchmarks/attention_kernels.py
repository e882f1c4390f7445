"""Triton attention kernels against the torch reference, on Qwen3-0.6B attention shapes (bf16).

    python benchmarks/attention_kernels.py [--quick]    # on a GPU (written for an H200)
    python benchmarks/attention_kernels.py --quick --cpu  # tiny shapes through the Triton interpreter

Every case is first checked against TorchAttention on the same data. Decode is timed as CUDA-graph replays (how the
engine runs it) rotating over several copies of the KV so that small cases are not served from L2; its figure is GB/s
over the K and V bytes that must be read, batch * context * kv_heads * head_dim * 2 bytes * 2, against the H200's
measured 4170 GB/s copy bandwidth. Prefill (causal, no history) counts 2 * 2 * len^2 * head_dim FLOPs per head and
sequence for QK^T and PV, halved for the causal mask: 2 * len^2 * heads * head_dim per sequence, against 748 TFLOP/s
measured for a bf16 matmul.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_GBPS = 4170.0
MATMUL_TFLOPS = 748.0
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256  # Qwen3-0.6B
L2_BYTES = 50 * 2**20  # H200 L2 is 50 MiB: rotate over more KV than that


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on CPU through TRITON_INTERPRET=1 (smoke test)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="fp8: decode reads an 8-bit cache plus a float32 scale per token and head")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cpu:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks import timing  # noqa: E402
from nanovllm.config import KV_CACHE_DTYPES  # noqa: E402
from nanovllm.kernels.decode import _decode_config, decode_attention, decode_splits  # noqa: E402
from nanovllm.layers.attention.fp8 import cache_layout, quantize, token_major  # noqa: E402
from nanovllm.layers.attention.torch_ref import TorchAttention  # noqa: E402
from nanovllm.layers.attention.triton_backend import TritonAttention  # noqa: E402
from nanovllm.layers.context import Context  # noqa: E402

DEVICE = "cpu" if ARGS.cpu else "cuda"
DTYPE = torch.float32 if ARGS.cpu else torch.bfloat16
TOL = dict(atol=1e-4, rtol=1e-4) if ARGS.cpu else dict(atol=2e-2, rtol=2e-2)
KV_DTYPE = KV_CACHE_DTYPES[ARGS.kv_cache_dtype]  # None: the 16-bit cache


def time_ms(fn, graph: bool = False) -> float:
    return timing.time_ms(fn, graph, ARGS.cpu, *((10, 50) if ARGS.quick else (25, 200)))


def decode_case(batch: int, context: int, splits: str) -> dict:
    """splits: 'auto' (the heuristic) or '1' (split-K off)."""
    heads, kv_heads, head_dim, block_size = (4, 2, 64, 16) if ARGS.cpu else (HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    blocks_per_seq = triton.cdiv(context, block_size)
    # bytes that must be read: K and V rows (and with fp8 their float32 scales)
    row_bytes = head_dim * (KV_DTYPE or DTYPE).itemsize + (4 if KV_DTYPE else 0)
    kv_bytes = batch * context * kv_heads * row_bytes * 2
    copies = 1 if ARGS.cpu else max(1, min(8, triton.cdiv(4 * L2_BYTES, kv_bytes)))
    num_blocks = copies * batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    scales = {}
    if KV_DTYPE is not None:
        kv, kv_scale = quantize(kv, KV_DTYPE)
        kv_scale = cache_layout(kv_scale)
        scales = dict(k_scale=kv_scale[0], v_scale=kv_scale[1])
    k_cache, v_cache = kv[0], kv[1]
    if KV_DTYPE is not None:  # V token-major, as the engine stores an fp8 cache
        v_cache = token_major(v_cache)
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).view(copies, batch, blocks_per_seq)
    q = torch.randn(batch, heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    contexts = [Context(False, context_lens=lens, block_tables=perm[c].contiguous()) for c in range(copies)]
    scale = head_dim ** -0.5
    block_n = _decode_config(head_dim, q.dtype, KV_DTYPE is not None)[0]
    num_splits = 1 if splits == "1" else decode_splits(batch, kv_heads, blocks_per_seq * block_size, block_n,
                                                       q.device)[0]

    def triton_decode(ctx: Context) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale,
                                num_splits=1 if splits == "1" else None, **scales)

    ref = TorchAttention().decode(q, k_cache, v_cache, contexts[0], scale, **scales)
    torch.testing.assert_close(triton_decode(contexts[0]).float(), ref.float(), **TOL)

    def run_all():
        for ctx in contexts:
            triton_decode(ctx)

    ms = time_ms(run_all, graph=True) / copies
    torch_ms = time_ms(lambda: TorchAttention().decode(q, k_cache, v_cache, contexts[0], scale, **scales)) \
        if splits == "auto" else float("nan")
    gbps = kv_bytes / ms / 1e6
    return dict(case=f"decode b={batch} ctx={context} splits={num_splits}", ms=ms, torch_ms=torch_ms,
                rate=f"{gbps:8.0f} GB/s", peak=100 * gbps / HBM_GBPS)


def prefill_case(num_seqs: int, length: int) -> dict:
    heads, kv_heads, head_dim = (4, 2, 64) if ARGS.cpu else (HEADS, KV_HEADS, HEAD_DIM)
    tokens = num_seqs * length
    q = torch.randn(tokens, heads, head_dim, dtype=DTYPE, device=DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=DEVICE)
    ctx = Context(True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length)
    scale = head_dim ** -0.5
    empty = torch.empty(0, device=DEVICE)
    backend, reference = TritonAttention(), TorchAttention()
    out = backend.prefill(q, k, v, empty, empty, ctx, scale)
    torch.testing.assert_close(out.float(), reference.prefill(q, k, v, empty, empty, ctx, scale).float(), **TOL)

    # torch's fused SDPA (flash / cuDNN on GPU) on the same batch, padded-free since all lengths are equal
    def sdpa():
        def split(t):
            return t.view(num_seqs, length, -1, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=scale,
                                              enable_gqa=True)

    ms = time_ms(lambda: backend.prefill(q, k, v, empty, empty, ctx, scale))
    torch_ms = time_ms(lambda: reference.prefill(q, k, v, empty, empty, ctx, scale))
    sdpa_ms = time_ms(sdpa)
    flops = num_seqs * 2 * length**2 * heads * head_dim
    tflops = flops / ms / 1e9
    return dict(case=f"prefill {num_seqs}x{length} causal", ms=ms, torch_ms=torch_ms, sdpa_ms=sdpa_ms,
                rate=f"{tflops:6.1f} TFLOP/s", peak=100 * tflops / MATMUL_TFLOPS)


def main():
    if not ARGS.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --quick --cpu for the interpreter smoke test")
    torch.manual_seed(0)
    rows = []
    if ARGS.cpu:
        decode_cases = [(2, 300)]  # two splits
        prefill_cases = [(2, 64)]
    else:
        decode_cases = [(256, 1024)] + [(b, c) for b in (1, 8, 64) for c in (1024, 4096)]
        if ARGS.quick:
            decode_cases = [(256, 1024), (1, 4096), (8, 4096)]
        prefill_cases = [(4, 4096)]
    for batch, context in decode_cases:
        for splits in ("auto", "1"):
            row = decode_case(batch, context, splits)
            rows.append(row)
            print(f"{row['case']:36s} {row['ms'] * 1e3:9.1f} us", flush=True)
    for num_seqs, length in prefill_cases:
        row = prefill_case(num_seqs, length)
        rows.append(row)
        print(f"{row['case']:36s} {row['ms'] * 1e3:9.1f} us", flush=True)

    where = "CPU interpreter (timings meaningless)" if ARGS.cpu else torch.cuda.get_device_name()
    print(f"\n{where}, {DTYPE}, KV cache {ARGS.kv_cache_dtype}; decode: {HEADS} q / {KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}"
          if not ARGS.cpu else f"\n{where}")
    print(f"{'case':36s} {'triton us':>10s} {'torch ref us':>13s} {'torch sdpa us':>14s} {'rate':>16s} {'% peak':>7s}")
    for r in rows:
        torch_us = "" if r["torch_ms"] != r["torch_ms"] else f"{r['torch_ms'] * 1e3:.1f}"
        sdpa_us = f"{r['sdpa_ms'] * 1e3:.1f}" if "sdpa_ms" in r else ""
        print(f"{r['case']:36s} {r['ms'] * 1e3:10.1f} {torch_us:>13s} {sdpa_us:>14s} {r['rate']:>16s} "
              f"{r['peak']:6.1f}%")
    print(f"peaks: {HBM_GBPS:.0f} GB/s (decode, K+V bytes read), {MATMUL_TFLOPS:.0f} TFLOP/s bf16 matmul (prefill, "
          "2*len^2*heads*head_dim FLOPs per causal sequence)")


if __name__ == "__main__":
    main()
