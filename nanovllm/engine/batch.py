"""What one step carries through the engine: the scheduler's choice, the runner's tensors, a launched step."""
from dataclasses import dataclass, field

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import Context
from nanovllm.sampling.sampler import SamplingTensors


@dataclass
class ScheduledBatch:
    """The scheduler's output for one step; the executor sends it to every rank."""

    seqs: list[Sequence]  # the sequences whose tokens this step computes
    is_prefill: bool
    # For every row of `rows`: where its sampled token goes in its token_ids; -1 for a chunk of a longer prefill,
    # whose sampled token is thrown away. Fixed at scheduling time, so a step settled later (async scheduling)
    # still knows its place after placeholders were appended.
    out_index: list[int]
    # n > 1: samples forked from seqs[row] as its prompt completes; each samples its first token from that row's
    # logits. They compute nothing this step.
    forks: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy): K/V to copy after the step
    # prompt_logprobs: (index into seqs, positions) for sequences whose prompt logprobs this step computes: the
    # logits at its first `positions` new tokens score the prompt tokens that follow them.
    prompt_logprobs: list[tuple[int, int]] = field(default_factory=list)
    # LoRA: (slot, LoRARequest) adapters to put into device slots before this step runs (lora/manager.py)
    lora_loads: list[tuple[int, object]] = field(default_factory=list)

    @property
    def rows(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the order of the sampled tokens."""
        return self.seqs + [child for child, _ in self.forks] if self.forks else self.seqs

    @property
    def sampled(self) -> list[bool]:
        return [i >= 0 for i in self.out_index]


@dataclass
class ForwardBatch:
    """The runner's tensors for one step, each part built by the part that reads it: the attention metadata in
    `context` by the attention backend (the runner adds the LM head's logits_indices), `sampling` by the sampler
    and its logits processors (rank 0)."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    context: Context
    sampling: SamplingTensors | None
    prompt_rows: torch.Tensor | None = None  # [rows] int64: hidden rows whose logits score prompt tokens
    prompt_hidden: torch.Tensor | None = None  # those rows' hidden states, kept by run_model
    staged: bool = False  # input_ids, positions and context are the decode graphs' own buffers (DecodeGraphs.stage)


@dataclass
class StepOutput:
    """What rank 0 reads back from a step, one entry per row of the batch's `rows`."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    # per sequence of ScheduledBatch.prompt_logprobs: a dict {token id: logprob} per scored prompt token
    prompt_logprobs: list[list[dict[int, float]]] | None = None


@dataclass
class LaunchedStep:
    """A step whose forward pass is queued and whose tokens are not sampled yet (rank 0): between the two, async
    scheduling may settle the step before it (a grammar's bitmask needs that step's tokens)."""

    batch: ScheduledBatch
    sampling: SamplingTensors
    logits: torch.Tensor  # (a small decode bucket's live in the graphs' pool until the next replay: sample first)
    prompt_logprobs: list | None = None


@dataclass
class PendingStep:
    """A step launched on the device whose sampled tokens have not been read back yet (rank 0)."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # [batch] on the device: the next step's input ids are taken from here
    tokens_host: torch.Tensor  # a copy in host memory (pinned on CUDA), valid once `ready` has passed
    logprobs_host: tuple | None = None
    prompt_logprobs: list | None = None  # already on the host (prefill steps are waited for)
    ready: "torch.cuda.Event | None" = None
