from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.engine.detokenizer import MAX_CONTEXT_TOKENS
from nanovllm.outputs import FlatLogprobs, Logprob
from nanovllm.sampling_params import SamplingParams

PENDING_TOKEN = -1  # async scheduling: stands for a sampled token that is still on the device


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, its KV blocks and how far its KV has been computed."""

    _ids = count()

    def __init__(self, token_ids: list[int], block_size: int, sampling_params: SamplingParams | None = None,
                 sample_index: int = 0):
        sampling_params = sampling_params or SamplingParams()
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = copy(token_ids)
        self.token_offset = 0  # a worker's copy holds only token_ids[token_offset:] (see __getstate__)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0  # tokens whose K/V are already in the cache
        self.num_scheduled_tokens = 0  # tokens computed in the current step
        self.num_prefix_hit_tokens = -1  # prompt tokens served by the prefix cache at first admission
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.prompt: str | None = None  # the prompt's text, when it came as text
        self.request_id = ""  # (the engine's count of requests, as vLLM's)
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.generator = None  # per-request torch.Generator when sampling_params.seed is set (rank 0, CPU)
        self.grammar = None  # structured outputs: this sample's SequenceGrammar (its matcher; rank 0)
        self.bad_words_ids: list[list[int]] = []  # SamplingParams.bad_words as token sequences (rank 0)
        self.logprobs: list[dict[int, Logprob]] | FlatLogprobs = self.new_logprobs()
        self.new_token = -1  # the token the last settled step added (streaming reports it)
        self.detokenizer = None  # IncrementalDetokenizer when text is needed while generating
        self.sample_index = sample_index  # which of the request's n samples this is
        # Samples 1..n-1 of the request (on sample 0 only), forked from it when its prompt's prefill completes.
        self.forks: list[Sequence] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | FlatLogprobs = self.new_logprobs()  # (sample 0)
        self.lora_request = None  # its LoRARequest, or None for the base model (rank 0)
        self.lora_id = 0  # its adapter's lora_int_id (0: the base model)
        self.cache_salt = -1  # the prefix cache's seed for its first block (lora/manager.py: cache_salt)
        self.lora_slot = -1  # the device slot its adapter is in while it runs (-1: none)

    def new_logprobs(self) -> list | FlatLogprobs:
        """An empty list of logprob dicts, or a FlatLogprobs (SamplingParams.flat_logprobs)."""
        return FlatLogprobs() if self.sampling_params.flat_logprobs else []

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: int | slice):
        if self.token_offset:  # a worker's copy; _prepare_prefill slices from token_offset on
            key = slice(key.start - self.token_offset, key.stop - self.token_offset)
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def text_context(self) -> list[int]:
        """The prompt's last tokens, from which the detokenizer picks those it decodes ahead of the completion, so its
        text reads as it does after the prompt (detokenizer.text_context)."""
        return self.token_ids[max(0, self.num_prompt_tokens - MAX_CONTEXT_TOKENS) : self.num_prompt_tokens]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt_logprobs and has not got them all yet (rank 0)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def samples_this_step(self) -> bool:
        """False for a chunk of a longer prefill: its sampled token is thrown away."""
        return self.num_cached_tokens + self.num_scheduled_tokens >= self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def drop_pending(self):
        """Remove trailing placeholders (a step still in flight when the sequence ended)."""
        while self.token_ids and self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids.pop()
        self.num_tokens = len(self.token_ids)
        self.last_token = self.token_ids[-1]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def set_token(self, index: int, token_id: int):
        """Put a sampled token at `index`: appended, or in place of its async placeholder."""
        if index == self.num_tokens:
            self.append_token(token_id)
            return
        self.token_ids[index] = token_id
        if index == self.num_tokens - 1:
            self.last_token = token_id

    # Workers only read the tokens this step computes (_prepare_prefill: seq[start:end]; _prepare_decode:
    # last_token), so only those travel, with token_offset saying where they start, and the last token. The
    # phase cannot be told from the state: a decode step and the one-token prefill of a preempted sequence whose
    # blocks all come back from the prefix cache look alike, and both need just the last token. Under async
    # scheduling the last token may be a placeholder (PENDING_TOKEN) whose K/V are not counted yet: the worker
    # takes that input from its copy of the previous step's tokens (ModelRunner.launch_chained).
    def __getstate__(self):
        start = self.num_cached_tokens
        return (self.seq_id, self.block_size, self.num_tokens, self.num_prompt_tokens, start,
                self.num_scheduled_tokens, self.block_table, self.token_ids[start : start + self.num_scheduled_tokens],
                self.last_token, self.lora_slot)

    def __setstate__(self, state):
        (self.seq_id, self.block_size, self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens,
         self.num_scheduled_tokens, self.block_table, self.token_ids, self.last_token, self.lora_slot) = state
        self.token_offset = self.num_cached_tokens
