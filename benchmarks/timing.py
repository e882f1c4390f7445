"""How the kernel benchmarks time a call (import it after setting TRITON_INTERPRET, which triton reads at import)."""
import statistics
import time

import torch
import triton


def time_ms(fn, graph: bool = False, cpu: bool = False, warmup: int = 25, rep: int = 200) -> float:
    """Median milliseconds per call of fn: CUDA events (triton.testing.do_bench) after a warm-up call; with graph, as
    CUDA-graph replays, so launch overhead is left out (as the engine's decode runs). cpu: wall clock, a few calls."""
    fn()
    if cpu:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    return triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")
