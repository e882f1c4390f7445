"""The fixed cost of a dependent kernel on this GPU: a CUDA graph of 252 launches (a batch-16 decode step's kernel
count for Qwen3-0.6B), each reading KB kilobytes over its programs and depending on the launch before, us a launch.

    python benchmarks/kernel_chain.py

Three ways: plain; under programmatic dependent launch (PDL) waiting first thing; under PDL with the reads before
the wait, as the one-row linear kernel loads W (kernels/gemv.py, pdl.py). Reads rotate over 8 copies, past
L2. A kernel that cannot read before its wait pays the plain column whatever its work; docs/benchmarks.md has
what this says of batch-16 decode.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LAUNCHES = 252
COPIES = 8


@triton.jit
def _touch(src_ptr, dst_ptr, prev_ptr, per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if PRELOAD:  # bytes no kernel writes, read before the wait
        for i in range(0, per_prog, BLOCK):
            acc += tl.load(src_ptr + pid * per_prog + i + tl.arange(0, BLOCK)).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    prev = tl.load(prev_ptr + pid)  # what the launch before wrote
    if not PRELOAD:
        for i in range(0, per_prog, BLOCK):
            acc += tl.load(src_ptr + pid * per_prog + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(dst_ptr + pid, tl.sum(acc) * 1e-9 + prev)


def us_per_launch(programs: int, kb: int, pdl: bool, preload: bool) -> float:
    per_prog = max(1024, kb * 1024 // 2 // programs // 1024 * 1024)  # bf16 elements, whole blocks
    src = torch.randn(COPIES, programs * per_prog, dtype=torch.bfloat16, device="cuda")
    bufs = [torch.zeros(programs, device="cuda") for _ in range(2)]

    def chain():
        for i in range(LAUNCHES):
            _touch[(programs,)](src[i % COPIES], bufs[(i + 1) % 2], bufs[i % 2], per_prog, BLOCK=1024, PDL=pdl,
                                PRELOAD=preload, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / LAUNCHES


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (Hopper or later for the PDL columns)")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(200):  # clocks up
        a @ a
    torch.cuda.synchronize()
    print(f"{'programs':>8s} {'KB':>6s} | us a launch: {'plain':>7s} {'PDL, wait first':>16s} {'PDL, read first':>16s}")
    for programs, kb in [(1, 2), (132, 264), (132, 4096), (132, 8192), (264, 16384), (528, 32768)]:
        r = [us_per_launch(programs, kb, pdl, pre) for pdl, pre in ((False, False), (True, False), (True, True))]
        print(f"{programs:8d} {kb:6d} | {'':13s}{r[0]:7.2f} {r[1]:16.2f} {r[2]:16.2f}", flush=True)


if __name__ == "__main__":
    main()
