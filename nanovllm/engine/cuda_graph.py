"""Decode-only CUDA graphs: one graph per batch-size bucket (and with LoRA a second one that applies the adapters),
sharing static buffers and one memory pool."""
import bisect
import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from nanovllm.layers.context import Context, reset_context, set_context

# Buckets up to this many rows (one process, no tensor parallelism) capture the LM head too and return logits: its
# kernel's Python launch is host time every step, which at batch 1 on a slower CPU sets the time per token.
# Larger buckets return hidden rows (a static [bucket, vocab] output would take 155 MB at 512 rows of a
# 151,936-token vocabulary).
LOGITS_IN_GRAPH_ROWS = 16


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


def compile_buckets(buckets: list[int]) -> list[int]:
    """The buckets whose kernel variants are likely to differ from the rest's (the start-up compiles theirs ahead
    first): the kernels pick tiles and paths at one row and up to 16 rows, Triton specializes integer arguments
    on 1 and on multiples of 16, and the MoE tiles change where twice the mean rows per expert passes a power of
    two (every range (a, 2a] holds one). So: every bucket up to 16, every power of two, every bucket that is not
    a multiple of 16, and the largest."""
    return [b for b in buckets if b <= 16 or b & (b - 1) == 0 or b % 16 or b == buckets[-1]]


class StaticInputs:
    """Named tensors carved from one device buffer, so that one host-to-device copy writes a step's values into all of
    them, rather than a small device copy per tensor between two graphs. Each tensor starts 16-byte aligned (Triton
    compiles a kernel per pointer alignment). The host side is numpy over a few pinned images taken in turn (torch
    calls on small host tensors cost microseconds each, which batch 1 pays in ms/token); `stage` rebuilds all it
    copies from the tensors' initial values (their padding), so no row keeps a value of an earlier step."""

    HOST_IMAGES = 4  # an image is written again only once the copy from it four steps ago is done

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device):
        self.layout, size = {}, 0  # name -> (byte offset, shape, dtype)
        for name, t in tensors.items():
            self.layout[name] = (size, t.shape, t.dtype)
            size += -(-t.numel() * t.element_size() // 16) * 16
        self.last = name  # the one whose rows a step copies only as far as its bucket
        self.row_bytes = tensors[name][0].numel() * tensors[name].element_size()
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.views = {name: self._view(self.buffer, name) for name in tensors}
        pin = self.buffer.is_cuda
        self.template = torch.empty(size, dtype=torch.uint8)  # the initial values, on the host
        self.images = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(self.HOST_IMAGES)]
        self.image_views = [{name: self._view(image, name).numpy() for name in tensors} for image in self.images]
        self.copied = [torch.cuda.Event() if pin else None for _ in self.images]
        self.turn = 0
        for name, t in tensors.items():
            self.views[name].copy_(t)
            self._view(self.template, name).copy_(t.cpu())
        self.template_np = self.template.numpy()
        self.images_np = [image.numpy() for image in self.images]

    def _view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        start, shape, dtype = self.layout[name]
        return buffer[start:start + shape.numel() * dtype.itemsize].view(dtype).view(shape)

    def stage(self, last_rows: int, write: Callable[[dict[str, np.ndarray]], None]):
        """`write` puts a step's values into numpy views of a host image (initial values wherever it writes
        nothing); one copy then sends every tensor, the last one only as far as its first `last_rows` rows."""
        i, self.turn = self.turn, (self.turn + 1) % len(self.images)
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # (long done: the copy went four steps ago)
        size = self.layout[self.last][0] + last_rows * self.row_bytes
        image = self.images[i]
        np.copyto(self.images_np[i][:size], self.template_np[:size])
        write(self.image_views[i])
        self.buffer[:size].copy_(image[:size], non_blocking=True)
        if self.copied[i] is not None:
            self.copied[i].record()


class DecodeGraphs:
    """Static input buffers plus one graph per bucket. The attention metadata buffers are the backend's
    (`graph_buffers`), so graphs work for any backend that supports them. With enable_lora each bucket has a second
    graph, for steps in which some sequence uses an adapter (each row's slot in the lora_slots buffer, the rows
    grouped by slot in lora_order); steps of
    the base model alone replay the first and pay nothing for LoRA. Built in two steps: the buffers here, the graphs
    in capture() (in between, the start-up compiles the buckets' kernels ahead: forward)."""

    def __init__(self, runner):
        cfg, device, backend = runner.config, runner.device, runner.backend
        self.model, self.forward_fn, self.backend = runner.model, runner.forward, backend
        self.buckets = decode_buckets(cfg.max_num_seqs)
        self.compile_first = compile_buckets(self.buckets)  # the start-up's compile passes, first and second
        self.compile_later = [b for b in self.buckets if b not in self.compile_first]
        max_bs = self.buckets[-1]
        max_blocks = (cfg.max_model_len + runner.block_size - 1) // runner.block_size
        hidden = cfg.hf_config.hidden_size
        metadata = backend.graph_buffers(max_bs, max_blocks, device)
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)
                  if isinstance(getattr(metadata, f.name), torch.Tensor)}
        self.modes = (False, True) if runner.lora is not None else (False,)  # graph variants: with LoRA or not
        # LoRA: each row's slot and the rows grouped by slot; a padding row has no adapter and its own place
        lora = {"lora_slots": torch.full((max_bs,), -1, dtype=torch.int32),
                "lora_order": torch.arange(max_bs, dtype=torch.int32)} if runner.lora is not None else {}
        # every input of the graphs in one buffer (stage); the block tables, the largest, last
        self.inputs = StaticInputs({"input_ids": torch.zeros(max_bs, dtype=torch.int64),
                                    "positions": torch.zeros(max_bs, dtype=torch.int64),
                                    "rows": torch.full((max_bs,), -1, dtype=torch.int64), **lora,
                                    **dict(sorted(fields.items(), key=lambda f: f[1].numel()))}, device)
        views = self.inputs.views
        self.lora_slots, self.lora_order = views.get("lora_slots"), views.get("lora_order")
        self.input_ids, self.positions, self.rows = views["input_ids"], views["positions"], views["rows"]
        self.step_views: dict[tuple[int, bool], tuple] = {}  # stage's views by batch size and LoRA
        self.metadata = dataclasses.replace(metadata, **{name: views[name] for name in fields})
        self.outputs = torch.zeros(max_bs, hidden, dtype=cfg.torch_dtype, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, LoRA) -> its graph
        self.logits_rows = LOGITS_IN_GRAPH_ROWS if cfg.tensor_parallel_size == 1 else 0
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}  # its graph's logits (in the graphs' memory pool)

    def _context(self, bs: int, lora: bool) -> Context:
        context = self.backend.graph_view(self.metadata, bs)
        if lora:
            context.lora_slots, context.lora_order = self.lora_slots[:bs], self.lora_order[:bs]
        return context

    @torch.inference_mode()
    def forward(self, buckets: list[int]):
        """These buckets' forward passes and logits, eagerly (for warmup.compile_ahead; buckets past
        LOGITS_IN_GRAPH_ROWS run the LM head's kernels outside their graphs, after each replay)."""
        try:
            for bs in buckets:
                for lora in self.modes:
                    set_context(self._context(bs, lora))
                    self.model.compute_logits(self.forward_fn(self.input_ids[:bs], self.positions[:bs]))
        finally:
            reset_context()

    @torch.inference_mode()
    def capture(self):
        pool = None
        try:
            for bs in reversed(self.buckets):  # largest first: its pool serves the smaller ones
                for lora in self.modes:
                    set_context(self._context(bs, lora))
                    self._step(bs)  # any JIT and scratch buffer before capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool):
                        logits = self._step(bs)
                    if logits is not None:
                        self.logits[bs, lora] = logits
                    pool = pool or graph.pool()
                    self.graphs[bs, lora] = graph
                    torch.cuda.synchronize()
        except BaseException:
            self.release()  # graphs captured so far would keep a TP group's NCCL communicator from closing
            raise
        finally:
            reset_context()

    def _step(self, bs: int) -> torch.Tensor | None:
        """What a bucket's graph runs: the logits of its rows (small buckets), else hidden rows into outputs."""
        hidden = self.forward_fn(self.input_ids[:bs], self.positions[:bs])
        if bs <= self.logits_rows:
            return self.model.compute_logits(hidden)
        self.outputs[:bs] = hidden
        return None

    def release(self):
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
        torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def stage(self, input_ids: list[int], positions: list[int], rows: list[int] | None, slot_mapping: list[int],
              context_lens: list[int], block_tables: list[list[int]],
              lora: tuple[list[int], list[int]] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, Context, torch.Tensor]:
        """A decode step's inputs written into the graphs' buffers by one copy, for replay(); rows: _previous_rows'
        list, the metadata as the backend's decode_context takes it, lora the rows' adapter slots and their order
        (lora/stack.py's step_slots; None: no row uses an adapter). Returns the buffers' views of the step's input
        ids, positions, context and rows (rows: empty when None)."""
        bs = len(input_ids)

        def write(views: dict[str, np.ndarray]):
            views["input_ids"][:bs] = input_ids
            views["positions"][:bs] = positions
            if rows is not None:
                views["rows"][:bs] = rows
            if lora is not None:
                views["lora_slots"][:bs], views["lora_order"][:bs] = lora
            self.backend.write_graph_step(views, slot_mapping, context_lens, block_tables)
        self.inputs.stage(bucket_for(self.buckets, bs), write)
        key = bs, lora is not None
        if key not in self.step_views:  # (views cost host time too: one set per batch size)
            self.step_views[key] = (self.input_ids[:bs], self.positions[:bs], self._context(*key), self.rows[:bs])
        ids, pos, context, rows_view = self.step_views[key]
        return ids, pos, context, rows_view if rows is not None else rows_view[:0]

    def replay(self, bs: int, lora: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the step of `bs` sequences that stage() wrote into the buffers (lora: with adapters): (hidden rows,
        None), or (None, logits) from a bucket that computes them. Both are valid until the next replay of any
        bucket (the logits are in the graphs' shared memory pool): read them on this stream first."""
        key = bucket_for(self.buckets, bs), lora
        self.graphs[key].replay()
        if key in self.logits:
            return None, self.logits[key][:bs]
        return self.outputs[:bs], None
