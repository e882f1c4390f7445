"""vLLM's LLMEngine (its EngineArgs: engine_args.py): a step loop over requests the caller names, each step
returning RequestOutputs, so vLLM scripts that drive the engine themselves (llm_engine_example.py, serving loops) run
unchanged.

    engine = LLMEngine.from_engine_args(EngineArgs(model=path))
    engine.add_request("0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...

It is a view of one LLM (`llm.llm_engine`); nanovllm's own step API (LLM.add_request(prompt, params), LLM.step())
is the engine underneath. Use one or the other on an LLM at a time."""
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from nanovllm.engine.detokenizer import stop_holdback
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.outputs import CompletionOutput, FlatLogprobs, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams, as_output_kind

_STATE_LOCK = threading.Lock()


@dataclass
class _Request:
    """What the view has returned of one request, so each step's output says only what the kind asks."""

    samples: list[Sequence]
    kind: RequestOutputKind
    tokens: list[int]  # per sample: completion tokens returned so far
    chars: list[int]  # per sample: characters of text returned so far
    logprobs: list  # per sample: the Logprob dicts so far, texts given once (CUMULATIVE and FINAL_ONLY)
    cumulative: list[float]
    prompt_logprobs: object = None
    prompt_returned: bool = False


def _num_settled(seq: Sequence) -> int:
    """Completion tokens read back (async scheduling holds a place for each token still on the device)."""
    n = seq.num_tokens
    while n > seq.num_prompt_tokens and seq.token_ids[n - 1] == PENDING_TOKEN:
        n -= 1
    return n - seq.num_prompt_tokens


class LLMEngine:
    """vLLM's LLMEngine over one nanovllm LLM: add_request(request_id, prompt, params), step() -> the RequestOutputs of
    the requests that step advanced, abort_request, has_unfinished_requests. SamplingParams.output_kind picks what a
    step returns for a request: CUMULATIVE (the default) its whole output so far, with every sample in `outputs`;
    DELTA only the new tokens, text and logprobs of the samples that advanced; FINAL_ONLY one output, when it
    finishes. While a request runs its text holds back what may still become a stop string that the text would
    leave out (nothing with include_stop_str_in_output, as in vLLM). An aborted request returns nothing more. The
    engine's other methods (LoRA, sleep, prefix cache, tokenizer, model_config) are the LLM's."""

    def __init__(self, llm):
        self.llm = llm
        # The requests live on the LLM, not here: llm.llm_engine makes a view each time (a view kept by the LLM
        # would be a reference cycle, and `del llm` would no longer free the GPU at once).
        with _STATE_LOCK:
            if not hasattr(llm, "_vllm_requests"):
                llm._vllm_requests = {}
                # step() from one thread and add_request from another: each waits for the other (the engine
                # underneath refuses concurrent calls, and a request added mid-step must be known when it returns)
                llm._vllm_lock = threading.RLock()
        self._requests: dict[str, _Request] = llm._vllm_requests
        self._lock = llm._vllm_lock

    @classmethod
    def from_engine_args(cls, engine_args, usage_context=None, stat_loggers=None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """The llm_engine of the LLM `engine_args` (an EngineArgs) describe (EngineArgs.make_llm; not imported here:
        engine_args.py builds on the LLM, which builds this view)."""
        return engine_args.make_llm().llm_engine

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                    lora_request=None, tokenization_kwargs: dict | None = None, trace_headers=None,
                    priority: int = 0, prompt_text: str | None = None) -> None:
        """Queue `prompt` (a str, token ids, or a TextPrompt / TokensPrompt dict) as request `request_id`, which its
        outputs carry. ValueError for an id still running, and for what generate() refuses; nothing is queued then.
        arrival_time and trace_headers are accepted and unused; tokenization_kwargs and priority only at None / 0."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (nanovllm generates text only), got "
                            f"{type(params).__name__}")
        if tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs={tokenization_kwargs!r} is not supported: prompts are tokenized "
                             "as generate() tokenizes them; use SamplingParams(truncate_prompt_tokens=k) to truncate")
        if priority != 0:
            raise ValueError(f"priority={priority!r} is not supported: requests are scheduled first come, first "
                             "served")
        if prompt_text is not None:
            raise ValueError("prompt_text goes with a preprocessed EngineCoreRequest, which nanovllm does not take; "
                             "pass the prompt itself")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already running; ids must be unique among "
                                 "unfinished requests")
            # (text as tokens arrive, for outputs before the end; a FINAL_ONLY request's is decoded once, at the end)
            final_only = as_output_kind(params.output_kind) == RequestOutputKind.FINAL_ONLY
            first = self.llm.add_request(prompt, params, lora_request, stream=not final_only)
            samples = [first, *first.forks]
            for seq in samples:
                seq.request_id = request_id
            n, checked = len(samples), first.sampling_params  # (its fields set after construction, normalized)
            empty = FlatLogprobs if checked.flat_logprobs else list
            self._requests[request_id] = _Request(samples, checked.output_kind, [0] * n, [0] * n,
                                                  [empty() for _ in range(n)], [0.0] * n)

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Stop these requests (ids not running are ignored): their KV blocks are freed and no step returns them
        again."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            ids = [rid for rid in dict.fromkeys(ids) if rid in self._requests]
            self.llm.abort_sequences([seq for rid in ids for seq in self._requests[rid].samples])
            for rid in ids:  # (only now: an abort refused, Busy while another call holds the LLM, keeps them)
                del self._requests[rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced (in the order they were added). An empty list
        does not mean the work is done: ask has_unfinished_requests(). An error leaves the requests queued (the
        step runs again at the next call), as the engine's own step does; tokens it applied before raising are
        returned by the next call."""
        with self._lock:
            self.llm.step()
            # What each request gained is read from its samples, not from the sequences llm.step() returns: a step
            # that raised after applying some tokens (async scheduling: the launch after a step it settled) returned
            # none, and a request it finished would never be returned (has_unfinished_requests() True for good).
            # The books (what each request has been given, which are done) change only once every output is made:
            # should making them raise (a KeyboardInterrupt while decoding text), the next step() returns them all.
            outputs, commits, done = [], [], []
            for rid, request in list(self._requests.items()):  # (in the order they were added)
                advanced = [seq for seq in request.samples if _num_settled(seq) > request.tokens[seq.sample_index]]
                finished = all(seq.is_finished for seq in request.samples)
                if not advanced and not finished:
                    continue
                if finished:
                    done.append(rid)
                if request.kind != RequestOutputKind.FINAL_ONLY or finished:
                    outputs.append(self._output(rid, request, advanced, finished, commits))
            for commit in commits:
                commit()
            for rid in done:
                del self._requests[rid]
            return outputs

    def _output(self, request_id: str, request: _Request, advanced: list[Sequence], finished: bool,
                commits: list) -> RequestOutput:
        """The request's output; what returning it changes in `request` is appended to `commits`, to run once the
        step's outputs are all made."""
        llm, first = self.llm, request.samples[0]
        sp = first.sampling_params
        delta = request.kind == RequestOutputKind.DELTA
        if request.prompt_logprobs is None and sp.prompt_logprobs is not None:
            request.prompt_logprobs = llm._logprobs(first.prompt_logprobs, sp.detokenize)
        prompt_logprobs = None if delta and request.prompt_returned else request.prompt_logprobs
        commits.append(lambda: setattr(request, "prompt_returned", True))
        samples = advanced if delta else request.samples
        return RequestOutput(request_id, first.prompt, first.prompt_token_ids, prompt_logprobs,
                             [self._sample(request, seq, delta, commits) for seq in samples], finished,
                             max(first.num_prefix_hit_tokens, 0), lora_request=first.lora_request)

    def _sample(self, request: _Request, seq: Sequence, delta: bool, commits: list) -> CompletionOutput:
        """One sample's CompletionOutput: all of it so far, or (delta) what it gained since it was last returned.
        Appends to `commits` the update of `request` that records it as returned."""
        i, sp, p = seq.sample_index, seq.sampling_params, seq.num_prompt_tokens
        start, settled = request.tokens[i], _num_settled(seq)
        new_tokens = seq.token_ids[p + start:p + settled]  # (a delta copies only what is new: no pass over it all)
        text = self.llm._text(seq)
        end = len(text) if seq.is_finished else \
            len(text) - stop_holdback(text, sp.stop_strings, sp.include_stop_str_in_output)
        text_start, chars = request.chars[i], max(request.chars[i], end)
        logprobs = cumulative = kept = None
        if sp.logprobs is not None:
            new = self.llm._logprobs(seq.logprobs[start:settled], sp.detokenize)
            cumulative = request.cumulative[i] + sum(entry[t] for entry, t in zip(new, new_tokens))
            if delta:
                logprobs = new
            else:  # (kept only where whole outputs read them again; a new list each step, never changed after, so
                # the output may hold the kept one)
                logprobs = kept = request.logprobs[i] + new

        def commit():
            request.tokens[i], request.chars[i] = settled, chars
            if cumulative is not None:
                request.cumulative[i] = cumulative
            if kept is not None:
                request.logprobs[i] = kept
        commits.append(commit)
        if delta:
            return CompletionOutput(i, text[text_start:end], new_tokens, cumulative, logprobs, seq.finish_reason,
                                    seq.stop_reason)
        return CompletionOutput(i, text[:end], seq.token_ids[p:p + settled], cumulative, logprobs, seq.finish_reason,
                                seq.stop_reason)

    # ---- the LLM's own methods, under vLLM's engine names ----------------------------------------
    @property
    def model_config(self):
        return self.llm.model_config

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def get_model_config(self):
        return self.llm.model_config

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def add_lora(self, lora_request) -> bool:
        return self.llm.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm.list_loras()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        with self._lock:  # (a step in another thread finishes first)
            return self.llm.reset_prefix_cache(reset_running_requests, reset_connector)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        self.llm.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        self.llm.stop_profile()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm.is_sleeping()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        return self.llm.collective_rpc(method, args, kwargs)
