"""Does NCCL work inside a decode CUDA graph the way the engine uses it? (2 GPUs; a diagnosis script.)

The engine's TP=2 decode with CUDA graphs hung on 2 H200s (docs/benchmarks.md). This replays the same pattern
without the engine, each variant in fresh processes with a deadline, and prints what passed:
  raw      our TPGroup (a ProcessGroupNCCL built from a TCPStore), all_reduce captured in a graph, then an
           eager gather after each replay, as the LM head does
  default  the same through torch's default group (init_process_group with device_id), as nano-vllm does

    python benchmarks/tp_graph_check.py
"""
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(rank: int, variant: str, port: int, result):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    timeout = timedelta(seconds=60)
    if variant == "raw":
        from nanovllm.utils.distributed import TPGroup
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
        group = TPGroup("cuda", store, rank, 2, timeout)
        all_reduce, gather = group.all_reduce, group.gather
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                device_id=device, timeout=timeout)
        all_reduce = dist.all_reduce

        def gather(x):
            parts = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
            dist.gather(x, parts, 0)
            return parts
    x = torch.ones(256, 1024, device=device)
    w = torch.randn(1024, 1024, device=device)

    def forward():
        y = x @ w
        for _ in range(4):
            y = all_reduce(y @ w * 1e-3)
        return y

    forward()  # eager: connects the communicator
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    torch.cuda.synchronize()
    result[rank] = 1  # captured
    for _ in range(20):
        graph.replay()
        gather(out[:4])
    torch.cuda.synchronize()
    result[rank] = 2  # replayed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ctx = mp.get_context("spawn")
    for variant in ("raw", "default"):
        result, port = ctx.Array("i", 2), free_port()
        procs = [ctx.Process(target=run, args=(r, variant, port, result), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        state = {0: "failed before capture", 1: "captured, HUNG or failed in replay", 2: "ok"}
        print(f"{variant:8s}", [state[v] for v in result[:]], [p.exitcode for p in procs], flush=True)
        for p in procs:
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
