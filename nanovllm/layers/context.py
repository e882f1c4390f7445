from collections.abc import Callable
from dataclasses import dataclass

import torch

# How per-step host data reaches the device: (list, dtype) -> tensor (the runner's pinned, non-blocking copy).
# Attention backends, the sampler and logits processors build their parts of a step with it.
ToDevice = Callable[[list, torch.dtype], torch.Tensor]


def to_device_packed(to_device: ToDevice, parts: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
    """Several lists of one dtype in one host-to-device copy, each returned as a 1-D view: small tensors each
    pinned and copied on their own would take most of a decode step's host time (benchmarks/host_time.py). Each
    view starts 16-byte aligned, as a tensor of its own would: Triton compiles a kernel per pointer alignment."""
    align = max(1, 16 // dtype.itemsize)
    flat, offsets = [], []
    for part in parts:
        offsets.append(len(flat))
        flat.extend(part)
        flat.extend([0] * (-len(flat) % align))
    packed = to_device(flat, dtype)
    return [packed[offset:offset + len(part)] for offset, part in zip(offsets, parts)]


@dataclass(slots=True)
class Context:
    """Per-step tensors read by attention and the LM head; set when a step's batch runs, reset after it.

    Prefill packs the new tokens of all sequences end to end: query i of sequence s covers
    cu_seqlens_q[s]:cu_seqlens_q[s+1]; its keys are all cu_seqlens_k[s+1]-cu_seqlens_k[s] tokens of
    the sequence so far. block_tables is set when some sequence has K/V already in the cache.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int32; -1: do not write
    context_lens: torch.Tensor | None = None  # [num_seqs] int32 (decode: tokens to attend, the new one included)
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32, right-padded with -1
    logits_indices: torch.Tensor | None = None  # [rows] int64: hidden rows the LM head scores; None: every row
    lora_slots: torch.Tensor | None = None  # [num_tokens] int32: each token's LoRA slot (-1: none); None: no adapter
    lora_order: torch.Tensor | None = None  # [num_tokens] int32: the tokens grouped by LoRA slot (lora/stack.py)


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context) -> Context:
    global _CONTEXT
    _CONTEXT = context
    return context


def reset_context():
    global _CONTEXT
    _CONTEXT = Context()
