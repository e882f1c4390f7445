"""Decode-only CUDA graphs: one graph per batch-size bucket, sharing static buffers and one memory pool."""
import bisect

import torch

from nanovllm.utils.context import Context, reset_context, set_context


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, and max_num_seqs itself, so every batch size finds a bucket."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(buckets: list[int], batch_size: int) -> int:
    """The smallest bucket that holds batch_size (ValueError past the largest)."""
    i = bisect.bisect_left(buckets, batch_size)
    if i == len(buckets):
        raise ValueError(f"batch of {batch_size} exceeds the largest CUDA-graph bucket {buckets[-1]}")
    return buckets[i]


class DecodeGraphs:
    """Static input buffers plus one graph per bucket. The attention metadata buffers are the backend's
    (`graph_buffers`), so graphs work for any backend that supports them."""

    def __init__(self, runner):
        cfg, model, device, backend = runner.config, runner.model, runner.device, runner.backend
        self.backend = backend
        self.buckets = decode_buckets(cfg.max_num_seqs)
        max_bs = self.buckets[-1]
        max_blocks = (cfg.max_model_len + runner.block_size - 1) // runner.block_size
        hidden = cfg.hf_config.hidden_size
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.metadata = backend.graph_buffers(max_bs, max_blocks, device)
        self.outputs = torch.zeros(max_bs, hidden, dtype=cfg.torch_dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        try:
            with torch.inference_mode():
                for bs in reversed(self.buckets):  # largest first: its pool serves the smaller ones
                    set_context(backend.graph_view(self.metadata, bs))
                    self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs])  # compile/JIT before capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool):
                        self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs])
                    pool = pool or graph.pool()
                    self.graphs[bs] = graph
                    torch.cuda.synchronize()
        except BaseException:
            self.release()  # graphs captured so far would keep a TP group's NCCL communicator from closing
            raise
        finally:
            reset_context()

    def release(self):
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        bs = input_ids.size(0)
        graph = self.graphs[bucket_for(self.buckets, bs)]
        self.input_ids[:bs] = input_ids
        self.positions[:bs] = positions
        self.backend.fill_graph_buffers(self.metadata, context)
        graph.replay()
        return self.outputs[:bs]
