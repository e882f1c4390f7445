"""What one step carries through the engine: the scheduler's choice, the runner's tensors, a launched step."""
from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.utils.context import Context


@dataclass
class ScheduledBatch:
    """The scheduler's output for one step; the executor sends it to every rank."""

    seqs: list[Sequence]
    is_prefill: bool
    # Where each sequence's sampled token goes in its token_ids; -1 for a chunk of a longer prefill, whose
    # sampled token is thrown away. Fixed at scheduling time, so a step settled later (async scheduling) still
    # knows its place after placeholders were appended.
    out_index: list[int]

    @property
    def sampled(self) -> list[bool]:
        return [i >= 0 for i in self.out_index]


@dataclass
class ForwardBatch:
    """The runner's tensors for one step, each part built by the part that reads it: attention metadata and the
    LM head's logits_indices in `context` (by the attention backend), `sampling` by the sampler (rank 0)."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    context: Context
    sampling: SamplingTensors | None


@dataclass
class PendingStep:
    """A step launched on the device whose sampled tokens have not been read back yet (rank 0)."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # [batch] on the device: the next step's input ids are taken from here
    tokens_host: torch.Tensor  # a copy in host memory (pinned on CUDA), valid once `ready` has passed
    logprobs_host: tuple | None = None
    ready: "torch.cuda.Event | None" = None
