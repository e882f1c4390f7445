import atexit
import logging
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.workers import start_model_runner
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import load_tokenizer

logger = logging.getLogger("nanovllm")

Prompt = str | list[int]


class LLMEngine:
    """Scheduler -> ModelRunner -> Sampler, one step at a time."""

    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, **kwargs)
        try:
            self.tokenizer = load_tokenizer(config.model)
        except (OSError, ValueError):
            if config.load_format != "dummy":
                raise
            self.tokenizer = None  # a bare config.json for benchmarks: token-id prompts only
        self.vocab_size = config.hf_config.vocab_size
        self.model_runner = start_model_runner(config)  # with tensor_parallel_size > 1, spawns the other ranks
        self.scheduler = Scheduler(config)
        self._closed = False
        atexit.register(self.exit)

    def exit(self):
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.exit)
        if self.model_runner is not None:
            self.model_runner.exit()
        self.model_runner = None

    # ---- requests -------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer: pass prompts as token-id lists")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        cfg = self.config
        if len(token_ids) > cfg.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={cfg.max_model_len}: "
                             "shorten it or raise max_model_len")
        blocks = (len(token_ids) + cfg.kvcache_block_size - 1) // cfg.kvcache_block_size
        if blocks > cfg.num_kvcache_blocks:
            raise ValueError(f"prompt needs {blocks} KV blocks but the cache has only {cfg.num_kvcache_blocks}: "
                             "shorten it or give the KV cache more room")
        return token_ids

    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        return Sequence(self._tokenize(prompt), self.config.kvcache_block_size, sampling_params)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One scheduler step. Returns the sequences that finished and the number of tokens computed
        (positive: prefill tokens, negative: decode sequences, as nano-vllm reports them)."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            raise RuntimeError("the scheduler could not schedule any sequence; the KV cache is too small "
                               "for the waiting requests")
        token_ids = self.model_runner.call("run", seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def _output(self, seq: Sequence) -> dict:
        return {
            "text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else "",
            "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason,
            "num_cached_tokens": max(seq.num_prefix_hit_tokens, 0),
        }

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
        if prompts and all(isinstance(p, int) for p in prompts):
            raise TypeError("prompts is a flat list of ints: wrap one token-id prompt in a list, [[...]]")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or exactly one per prompt")
        else:
            sampling_params = [sampling_params] * len(prompts)
        if not self.scheduler.is_finished():
            raise RuntimeError("generate() called while requests added with add_request are still running")
        # Validate every request before queueing any, so a bad one leaves the engine untouched.
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tput = decode_tput = 0.0
        try:
            while not self.is_finished():
                t = perf_counter()
                finished, num_tokens = self.step()
                dt = perf_counter() - t
                if num_tokens > 0:
                    prefill_tput = num_tokens / dt
                else:
                    decode_tput = -num_tokens / dt
                bar.set_postfix(prefill=f"{prefill_tput:.0f}tok/s", decode=f"{decode_tput:.0f}tok/s")
                bar.update(len(finished))
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                if not seq.is_finished:
                    self.scheduler.abort(seq)
            raise
        finally:
            bar.close()
        return [self._output(seq) for seq in seqs]
