import atexit
import logging
from collections.abc import Iterator
from numbers import Integral
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from nanovllm.engine.executor import Executor, UniprocExecutor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import load_generation_config, load_tokenizer

logger = logging.getLogger("nanovllm")

Prompt = str | list[int]

# generation_config.json fields that become the default SamplingParams, as vLLM does
_GENERATION_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _nothing_to_schedule() -> RuntimeError:
    return RuntimeError("the scheduler could not schedule any sequence; the KV cache is too small for the "
                        "waiting requests")


def make_executor(config: Config) -> Executor:
    if config.tensor_parallel_size > 1:
        from nanovllm.engine.tensor_parallel import MultiprocExecutor  # spawns ranks 1..N-1
        return MultiprocExecutor(config)
    return UniprocExecutor(config)


def _num_tokens(batch: ScheduledBatch) -> int:
    """step()'s count: prefill tokens computed (positive) or decode sequences (negative)."""
    return sum(seq.num_scheduled_tokens for seq in batch.seqs) if batch.is_prefill else -len(batch.seqs)


def default_sampling_params(model: str) -> SamplingParams:
    """SamplingParams from the checkpoint's generation_config.json where it sets them."""
    gen = load_generation_config(model)
    return SamplingParams(**{k: gen[k] for k in _GENERATION_DEFAULTS if gen.get(k) is not None})


class LLMEngine:
    """Scheduler -> Executor (a ModelRunner per rank) -> Sampler, one step at a time."""

    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, **kwargs)
        try:
            self.tokenizer = load_tokenizer(config.model)
        except (OSError, ValueError):
            if config.load_format != "dummy":
                raise
            self.tokenizer = None  # a bare config.json for benchmarks: token-id prompts only
        self.vocab_size = config.hf_config.vocab_size
        self.executor = make_executor(config)  # with tensor_parallel_size > 1, spawns the other ranks
        self.num_kvcache_blocks = self.executor.num_kvcache_blocks
        self.scheduler = Scheduler(config, self.num_kvcache_blocks)
        self.default_sampling_params = default_sampling_params(config.model)
        self._closed = False
        self._pending = None  # async scheduling: the decode step launched and not yet settled
        atexit.register(self.exit)

    def exit(self):
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.exit)
        on_cuda = self.config.device == "cuda"
        if self.executor is not None:
            self.executor.shutdown()
        self.executor = None
        if on_cuda:  # hand the cache, weights and graph pool back to the device
            import gc

            import torch
            gc.collect()
            torch.cuda.empty_cache()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run the public ModelRunner method `method` on every rank (as vLLM's LLM.collective_rpc does for its
        workers); returns each rank's result, in rank order. E.g. `llm.collective_rpc("describe")`."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        if self._pending is not None or not self.scheduler.is_finished():
            raise RuntimeError("collective_rpc() called while requests are running; finish or abandon them first")
        return self.executor.collective_rpc(method, tuple(args), kwargs)

    # ---- requests -------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer: pass prompts as token-id lists")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, Integral) and not isinstance(t, bool)
                                                       for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy and torch integers too
        else:
            raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        # (The engine refuses at start a cache of fewer than max_model_len tokens, so such a prompt always fits.)
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}: "
                             "shorten it or raise max_model_len")
        return token_ids

    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        bad = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if (sampling_params.logprobs or 0) > self.vocab_size:
            raise ValueError(f"logprobs={sampling_params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        return Sequence(self._tokenize(prompt), self.config.kvcache_block_size, sampling_params)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One scheduler step. Returns the sequences that received a token (check `.is_finished`) and
        the number of tokens computed (positive: prefill tokens, negative: decode sequences).
        With async_scheduling, a decode step returns the tokens of the step launched before it."""
        if self.config.async_scheduling:
            return self._step_async()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise _nothing_to_schedule()
        return self._apply(batch, *self.executor.run(batch)), _num_tokens(batch)

    def _step_async(self) -> tuple[list[Sequence], int]:
        """Launch decode step N+1 before waiting for step N's tokens, so the CPU schedules and prepares while
        the GPU computes. Inputs that step N sampled stay on the device; placeholders stand for them in the
        sequences until N is settled. A sequence that step N ends still runs (uselessly) in N+1."""
        pending, scheduler = self._pending, self.scheduler
        if pending is not None and scheduler.can_prefill():  # a prefill comes next: it needs the real tokens
            return self._settle(), _num_tokens(pending.batch)
        batch = scheduler.schedule()
        if not batch.seqs:
            if pending is not None:
                return self._settle(), _num_tokens(pending.batch)
            raise _nothing_to_schedule()
        if batch.is_prefill:  # (nothing is pending: waiting sequences made us settle above)
            return self._apply(batch, *self.executor.run(batch)), _num_tokens(batch)
        self._pending = self.executor.launch(batch, pending)
        for seq in batch.seqs:
            seq.append_token(PENDING_TOKEN)
        return (self._settle(pending) if pending is not None else []), _num_tokens(batch)

    def _settle(self, step=None) -> list[Sequence]:
        """Wait for a launched step's tokens and apply them."""
        if step is None or step is self._pending:
            step, self._pending = self._pending, None
        return self._apply(step.batch, *self.executor.settle(step))

    def _apply(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list | None) -> list[Sequence]:
        updated = self.scheduler.postprocess(batch, token_ids, logprobs)
        self._update_texts(updated)
        return updated

    def _update_texts(self, seqs: list[Sequence]):
        for seq in seqs:
            if seq.detokenizer is not None:
                self._update_text(seq)

    def _update_text(self, seq: Sequence):
        """Incremental text for streaming and stop strings; finishes the sequence on a stop string."""
        detok = seq.detokenizer
        delta = detok.add(seq.new_token)
        if seq.is_finished:
            delta += detok.flush()
        stops = seq.sampling_params.stop_strings
        # the detokenizer holds exactly the settled completion tokens (async scheduling may have appended more)
        if not stops or not delta or len(detok.token_ids) < seq.sampling_params.min_tokens:
            return
        hit = find_stop(detok.text, len(delta), stops)
        if hit is not None:
            detok.text = detok.text[:hit]  # the returned text ends before the stop string
            if not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            seq.finish_reason = "stop"

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._pending is None

    def _text(self, seq: Sequence) -> str:
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        if self.tokenizer is None:
            return ""
        skip = seq.sampling_params.skip_special_tokens
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=skip)

    def _output(self, seq: Sequence) -> dict:
        out = {
            "text": self._text(seq),
            "token_ids": seq.completion_token_ids,
            "prompt_token_ids": seq.prompt_token_ids,
            "finish_reason": seq.finish_reason,
            "num_cached_tokens": max(seq.num_prefix_hit_tokens, 0),
        }
        if seq.sampling_params.logprobs is not None:
            out["logprobs"] = seq.logprobs
        return out

    def _make_sequences(self, prompts, sampling_params, stream: bool) -> list[Sequence]:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
        if prompts and all(isinstance(p, int) for p in prompts):
            raise TypeError("prompts is a flat list of ints: wrap one token-id prompt in a list, [[...]]")
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or exactly one per prompt")
        else:
            sampling_params = [sampling_params] * len(prompts)
        if not self.scheduler.is_finished():
            raise RuntimeError("generate() called while other requests are still running (an unfinished "
                               "stream, or requests added with add_request)")
        # Validate every request before queueing any, so a bad one leaves the engine untouched.
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            sp = seq.sampling_params
            if (stream or sp.stop_strings) and self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
            elif sp.stop_strings:
                raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        return seqs

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> Iterator[list[Sequence]]:
        """Drive the engine until `seqs` are done, yielding the sequences updated by each step.
        If the caller stops early or a step fails, unfinished sequences are aborted."""
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tput = decode_tput = 0.0
        try:
            while not self.is_finished():
                t = perf_counter()
                updated, num_tokens = self.step()
                dt = perf_counter() - t
                if num_tokens > 0:
                    prefill_tput = num_tokens / dt
                else:
                    decode_tput = -num_tokens / dt
                if use_tqdm:
                    bar.set_postfix(prefill=f"{prefill_tput:.0f}tok/s", decode=f"{decode_tput:.0f}tok/s",
                                    refresh=False)
                    bar.update(sum(seq.is_finished for seq in updated))
                yield updated
        finally:
            bar.close()
            self._pending = None  # a step still in flight only touches these sequences' (now freed) blocks
            for seq in seqs:  # leave the engine clean for the next call
                if not seq.is_finished:
                    self.scheduler.abort(seq)

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, stream: bool = False) -> list[dict] | Iterator[dict]:
        """Generate for every prompt. Returns one dict per prompt, in order: text, token_ids,
        prompt_token_ids, finish_reason ("stop" or "length"), num_cached_tokens (and logprobs when asked).
        With stream=True, returns an iterator of per-step deltas instead (see `stream`)."""
        if stream:
            return self.stream(prompts, sampling_params, use_tqdm=use_tqdm)
        seqs = self._make_sequences(prompts, sampling_params, stream=False)
        for _ in self._run(seqs, use_tqdm):
            pass
        return [self._output(seq) for seq in seqs]

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
               use_tqdm: bool = False) -> Iterator[dict]:
        """Yield results as they are produced: one dict per sequence per step with "index" (the prompt's
        position), "text" (new text), "token_ids" (new token ids), "finished" and "finish_reason"
        (and "logprobs" for the new tokens when asked). Concatenated, the deltas equal generate()'s output.
        Requests are validated here, before the first item is yielded."""
        seqs = self._make_sequences(prompts, sampling_params, stream=True)
        return self._stream(seqs, use_tqdm)

    def _stream(self, seqs: list[Sequence], use_tqdm: bool) -> Iterator[dict]:
        index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        emitted = dict.fromkeys(index, 0)  # characters of text already yielded
        for updated in self._run(seqs, use_tqdm):
            for seq in updated:
                text, stops = self._text(seq), seq.sampling_params.stop_strings
                # hold back what could still turn out to be the start of a stop string
                end = len(text) if seq.is_finished else len(text) - stop_holdback(text, stops)
                start = emitted[seq.seq_id]
                emitted[seq.seq_id] = max(start, end)
                item = {"index": index[seq.seq_id], "text": text[start:end], "token_ids": [seq.new_token],
                        "finished": seq.is_finished, "finish_reason": seq.finish_reason}
                if seq.sampling_params.logprobs is not None:
                    item["logprobs"] = seq.logprobs[-1:]
                yield item
