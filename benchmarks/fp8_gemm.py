"""Qwen3-8B's four projections (qkv, o, gate_up, down) in fp8 against bf16, at decode and prefill row counts: how
much faster fp8 weights can make the matmul part of a step, which bounds what they can give bench.py.

    python benchmarks/fp8_gemm.py [--rows 16 64 128 256 1024 16384]

Each product runs as a CUDA graph over weight copies rotated past the 50 MB L2 (as 36 layers are); us per layer is
the sum of the four. Columns: bf16 (F.linear, cuBLAS); fp8 per channel as the engine runs it (kernels/fp8_gemm.py's
fp8_linear: the activation quantizer, then _scaled_mm with row-wise scales; w8a16 up to SMALL_ROWS rows); the
_scaled_mm alone on x quantized beforehand, without and with fast accumulation (use_fast_accum: the engine keeps it
off, twice the error); Qwen's 128 x 128 block scales as the engine runs them (cuBLASLt's block-scaled GEMM where
this torch has it, else the Triton block GEMM).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks import timing  # noqa: E402
from nanovllm.kernels import fp8_gemm  # noqa: E402
from nanovllm.quantization.fp8 import FP8, FP8_MAX, quantize_rows  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's format: one scale per 128 x 128 block, repeated over the block's rows as the engine keeps them."""
    n, k = w.shape
    blocks = w.float().reshape(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [n / 128, k / 128]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    return q, scale.repeat_interleave(128, dim=0)


def products(x, ws, channel, block) -> list:
    """One call per weight copy of each column's product (the order of main's labels)."""
    q, s = fp8_gemm.quantize_activations(x, None)
    return [
        lambda: [F.linear(x, w) for w in ws],
        lambda: [fp8_gemm.fp8_linear(x, w, sc, None, None) for w, sc in channel],
        lambda: [torch._scaled_mm(q, w.t(), scale_a=s, scale_b=sc[None, :], out_dtype=x.dtype) for w, sc in channel],
        lambda: [torch._scaled_mm(q, w.t(), scale_a=s, scale_b=sc[None, :], out_dtype=x.dtype, use_fast_accum=True)
                 for w, sc in channel],
        lambda: [fp8_gemm.fp8_linear(x, w, sc, 128, None, block_scale=bs) for w, sc, bs in block],
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 1024, 16384])
    args = p.parse_args()
    torch.manual_seed(0)
    labels = ["bf16", "fp8 channel", "_scaled_mm", "fast accum", "fp8 block"]
    total = {m: [0.0] * len(labels) for m in args.rows}
    for name, n, k in SHAPES:
        copies = max(1, triton.cdiv(256 * 2**20, n * k * 2))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(copies)]
        channel = [quantize_rows(w) for w in ws]
        use_cublaslt = fp8_gemm.blockwise_scaled_mm_works(ws[0].device) and k % 512 == 0
        block = [(q, sc, sc[::128].contiguous() if use_cublaslt else None) for q, sc in map(block_quantize, ws)]
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x.float(), ws[0].float())
            runs = products(x, ws, channel, block)
            times = []
            for label, run in zip(labels, runs):
                err = ((run()[0].float() - ref).norm() / ref.norm()).item()
                if err > 0.1:
                    raise RuntimeError(f"{name} M={m} {label}: relative error {err:.3f}")
                times.append(timing.time_ms(run, graph=True, rep=100) * 1e3 / copies)  # us a call
            for i, us in enumerate(times):
                total[m][i] += us
            print(f"{name:8s} M={m:5d} " + "  ".join(f"{label} {us:8.1f}" for label, us in zip(labels, times)),
                  flush=True)
        ws = channel = block = None
        torch.cuda.empty_cache()
    print("\n== one layer's four projections, us (x bf16) ==")
    print(f"{'rows':>6s} " + " ".join(f"{label:>17s}" for label in labels))
    for m, t in total.items():
        print(f"{m:6d} {t[0]:17.1f} " + " ".join(f"{us:9.1f} ({t[0] / us:4.2f}x)" for us in t[1:]))


if __name__ == "__main__":
    main()
