import atexit
import gc
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.checkpoint.loader import check_tokenizer_files, load_generation_config, load_tokenizer
from nanovllm.config import Config
from nanovllm.distributed.executor import Executor, UniprocExecutor
from nanovllm.engine.batch import ScheduledBatch, StepOutput
from nanovllm.engine.call_guard import CallGuard, Stream, interrupt_after
from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_after, find_stop, stop_holdback
from nanovllm.engine.requests import Prompt, RequestChecker, as_request_lists
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.inputs import call_prompts, prompt_parts
from nanovllm.lora.request import LoRARequest, cache_salt
from nanovllm.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from nanovllm.sampling.structured_outputs import GrammarCompiler, accept_tokens, grammar_threads
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")
EXIT_WAIT_S = 30  # how long exit() waits for a step another thread is running


# generation_config.json fields that become the default SamplingParams (theirs -> ours), as vLLM does
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _nothing_to_schedule() -> RuntimeError:
    return RuntimeError("the scheduler could not schedule any sequence; the KV cache is too small for the "
                        "waiting requests")


def make_executor(config: Config) -> Executor:
    if config.tensor_parallel_size > 1:
        from nanovllm.distributed.tensor_parallel import MultiprocExecutor  # spawns ranks 1..N-1
        return MultiprocExecutor(config)
    return UniprocExecutor(config)


def _num_tokens(batch: ScheduledBatch) -> int:
    """step()'s count: prefill tokens computed (positive) or decode sequences (negative)."""
    return sum(seq.num_scheduled_tokens for seq in batch.seqs) if batch.is_prefill else -len(batch.seqs)


def default_sampling_params(model: str) -> SamplingParams:
    """SamplingParams from the checkpoint's generation_config.json where it sets them; a value SamplingParams
    refuses raises ValueError naming the file."""
    gen = load_generation_config(model)
    try:
        return SamplingParams(**{ours: gen[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
                                 if gen.get(theirs) is not None})
    except (TypeError, ValueError) as e:
        raise ValueError(f"the checkpoint's generation_config.json sets a default nanovllm cannot use: {e}; fix "
                         "the file, or remove the field") from None


def _weight_pairs(weights) -> list[tuple] | str:
    """update_weights' argument as a checkpoint directory or a list of (name, tensor) pairs, each pair checked
    (a tensor that holds no data, such as a meta tensor, cannot be copied: refused before anything is written)."""
    import torch
    if isinstance(weights, Mapping) and "update_info" in weights or hasattr(weights, "update_info"):
        raise TypeError("update_weights got newest vLLM's weight-transfer request ({'update_info': ...}, for its NCCL "
                        "or IPC backends); nanovllm's update_weights takes the weights themselves: (name, tensor) "
                        "pairs, a state dict (e.g. model.state_dict()) or a checkpoint directory")
    if isinstance(weights, (str, os.PathLike)):
        weights = os.fspath(weights)
        if not os.path.isdir(weights):
            raise ValueError(f"update_weights: {weights!r} is not a checkpoint directory")
        return weights
    if isinstance(weights, Mapping):
        weights = list(weights.items())
    elif isinstance(weights, Iterable) and not isinstance(weights, torch.Tensor):
        weights = list(weights)
    else:
        raise TypeError(f"update_weights takes (name, tensor) pairs, a state dict or a checkpoint directory, "
                        f"got {type(weights).__name__}")
    for i, pair in enumerate(weights):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            got = f"a {type(pair).__name__}" + (f" of length {len(pair)}" if isinstance(pair, (tuple, list)) else "")
            raise TypeError(f"update_weights: item {i} must be a (name, tensor) pair, got {got}")
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: item {i} must be a (str, torch.Tensor) pair, got "
                            f"({type(name).__name__}, {type(tensor).__name__})")
        if tensor.is_meta or tensor.layout != torch.strided:
            raise ValueError(f"update_weights: {name!r} is a {'meta' if tensor.is_meta else str(tensor.layout)} "
                             "tensor, which holds no values to copy; send a dense tensor with the weights")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}; weights are floating-point tensors")
    return weights


def _spaces(sp: SamplingParams) -> dict:
    """decode()'s spaces_between_special_tokens where it is not the default (fast tokenizers ignore it)."""
    return {} if sp.spaces_between_special_tokens else {"spaces_between_special_tokens": False}


def _stopped_by_token(seq: Sequence) -> bool:
    """Ended by EOS or a stop token id, whose text the output leaves out unless include_stop_str_in_output (as
    vLLM); the token stays in token_ids."""
    return (seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            and not seq.sampling_params.include_stop_str_in_output)


def check_awake(asleep: set[str], weights_discarded: str | None):
    """RuntimeError unless requests may run: nothing asleep (sleep()), and the weights a whole set."""
    if asleep:
        raise RuntimeError(f"the engine is asleep ({', '.join(sorted(asleep))} freed by sleep()); call wake_up() "
                           "first")
    if weights_discarded:
        raise RuntimeError(f"{weights_discarded}; load a full set with update_weights() first")


class _Background:
    """fn(*args) in a daemon thread; result() waits for it and returns its value or raises its exception."""

    def __init__(self, fn, *args):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="nanovllm-tokenizer", daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def wait(self):
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class LLMEngine:
    """Scheduler -> Executor (a ModelRunner per rank) -> Sampler, one step at a time."""

    def __init__(self, model: str | None = None, **kwargs):
        start = perf_counter()
        self.config = config = Config.from_kwargs(model, **kwargs)
        self.vocab_size = config.hf_config.vocab_size
        self.startup = {"config": perf_counter() - start}  # seconds; the runners log theirs
        # Importing transformers' AutoTokenizer is seconds of Python on some machines (it imports the generation
        # stack): it runs while the executor loads weights, warms up and captures graphs. Started right after the
        # config, which is either a PlainConfig read from config.json alone (well under a millisecond, nothing of
        # transformers imported: from here on only this thread imports transformers) or transformers' AutoConfig,
        # whose imports would otherwise wait on the thread's import locks.
        # (A checkpoint without a tokenizer is refused here, before the weights load, unless load_format="dummy".)
        try:
            check_tokenizer_files(config.model)
            tokenizer = _Background(load_tokenizer, config.model)
        except OSError:
            if config.load_format != "dummy":
                raise
            tokenizer = None  # a bare config.json for benchmarks: token-id prompts only
        try:
            # generation_config.json is read before any process starts: a bad default fails here, with nothing to undo
            self.default_sampling_params = default_sampling_params(config.model)
            if config.device == "cuda":
                # an engine dropped inside a reference cycle (a notebook's, a test's) keeps its weights and KV cache
                # until the collector runs: collect now, before this one loads weights and sizes its cache from what
                # is free (otherwise the next LLM(...) can find no memory left for its cache)
                gc.collect()
            self.executor = make_executor(config)  # with tensor_parallel_size > 1, spawns the other ranks
        except BaseException:
            # the tokenizer thread's first import of transformers, left running, made the next LLM(...)'s import of
            # AutoTokenizer fail (ImportError: cannot import name): let it finish
            if tokenizer is not None:
                tokenizer.wait()
            raise
        # shuts the executor down when the engine is garbage-collected without exit(): it holds the executor, never
        # the engine, so `del llm` frees the GPU memory for the next LLM (a bound method registered with atexit
        # kept the engine, its weights and its KV cache, alive until exit). Also registered with atexit itself:
        # weakref.finalize's own exit hook may run after multiprocessing's, which would first join (or terminate)
        # the worker processes that this shutdown stops politely. Registered at once: whatever fails from here on
        # shuts the workers down too.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        atexit.register(self._finalizer)
        try:
            self._finish_start(tokenizer)
        except BaseException:
            self._finalizer()
            atexit.unregister(self._finalizer)
            raise

    def _finish_start(self, tokenizer: "_Background | None"):
        config = self.config
        start = perf_counter()
        try:
            self.tokenizer = tokenizer.result() if tokenizer is not None else None
        except (OSError, ValueError):
            if config.load_format != "dummy":
                raise
            self.tokenizer = None  # a bare config.json for benchmarks: token-id prompts only
        self.startup["tokenizer (waited for)"] = perf_counter() - start
        self.num_kvcache_blocks = self.executor.num_kvcache_blocks
        self.scheduler = Scheduler(config, self.num_kvcache_blocks)
        if config.enable_lora:
            from nanovllm.lora.manager import LoRAManager
            self.scheduler.lora = LoRAManager(config)
        self.requests = RequestChecker(self.vocab_size, config.max_model_len, config.max_num_seqs,
                                       config.kvcache_block_size, self.num_kvcache_blocks, self.tokenizer, config.model,
                                       longer=config.longer_prompts,
                                       image_token_ids=config.image_token_ids)
        # One caller at a time: generate, a started stream, step and the weight and memory calls each hold it. A
        # second caller (another thread, or this one while its stream is open) is refused at once.
        self._exclusive = CallGuard()
        self._request_ids = itertools.count()  # RequestOutput.request_id, as vLLM counts them
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token of each id seen, decoded once
        self._pending = None  # async scheduling: the decode step launched and not yet settled
        self._stepping = threading.RLock()  # held while a step runs (exit() waits for it)
        # async scheduling: a step whose settle raised (a KeyboardInterrupt while waiting for the device): its
        # tokens are still on the device, and the next step reads them first (sampling it again would draw a seeded
        # request's next numbers, and leave its placeholders in the output)
        self._unsettled = None
        # step() and reset_prefix_cache(): their requests outlive a call that raises, so a Ctrl-C while a step's tokens
        # are applied (scheduler, grammars, texts) waits until they all are: half applied, a request would miss a
        # piece of its text, or decode a position again (generate and stream cancel theirs: no wait)
        self._apply_whole = False
        self._asleep: set[str] = set()  # what sleep() freed and wake_up() has not brought back
        # sleep(level=2) or a weight update that failed while writing: the weights are not a whole set until an
        # update_weights sends every one (the value says why, for the error)
        self._weights_discarded: str | None = None
        self._grammars: GrammarCompiler | None = None  # structured outputs: made with the first constrained request
        self._grammar_threads = grammar_threads(config.device)  # that advance the matchers

    def exit(self):
        if self._exclusive.closed:
            return
        self._exclusive.closed = True
        on_cuda = self.config.device == "cuda"
        # a step another thread is running finishes first (its call then ends with shut_down_meanwhile): tearing
        # down under it would free its graphs or stop tensor-parallel workers mid-collective. (A re-entrant lock:
        # exit() from the stepping thread itself goes on; the timeout keeps a stuck step from blocking exit; a
        # KeyboardInterrupt while waiting still shuts down, or the engine would be closed but alive.)
        waited = False
        try:
            waited = self._stepping.acquire(timeout=EXIT_WAIT_S)
            if not waited:
                logger.warning("exit(): a step still running after %d s; shutting down under it", EXIT_WAIT_S)
        finally:
            try:
                self._finalizer()  # (once: later calls do nothing)
                atexit.unregister(self._finalizer)
                self.executor = None
            finally:
                if waited:
                    self._stepping.release()
        if on_cuda:  # hand the cache, weights and graph pool back to the device
            import torch
            gc.collect()
            torch.cuda.empty_cache()

    def _check_idle(self, what: str):
        """(Under _exclusive.) Refuse `what` while requests are queued or running."""
        if not self.is_finished():
            raise RuntimeError(f"{what}() called while requests are running (requests added with add_request and "
                               "not finished); finish or abandon them first")

    # the engine keeps books on these (prefix cache, what is asleep): they go through its own methods
    _ENGINE_RPCS = {"update_weights": "update_weights", "sleep": "sleep", "wake_up": "wake_up",
                    "check_weights": "update_weights"}
    # vLLM's worker methods that vLLM RL scripts call to load new weights: what each does there
    _VLLM_WORKER_RPCS = {
        "reload_weights": "reloads the weights from the checkpoint, or from a weights_iterator of (name, tensor) pairs",
        "update_config": "changes the config, so that reload_weights then reads another checkpoint or load_format "
                         "(nanovllm's config is fixed once the engine runs)",
    }

    def collective_rpc(self, method: str, args: tuple | None = (), kwargs: dict | None = None) -> list:
        """Run the public ModelRunner method `method` on every rank (as vLLM's LLM.collective_rpc does for its
        workers); returns each rank's result, in rank order. E.g. `llm.collective_rpc("describe")`."""
        if method in self._ENGINE_RPCS:
            raise ValueError(f"collective_rpc({method!r}) would bypass the engine's prefix cache and sleep state; "
                             f"call llm.{self._ENGINE_RPCS[method]}() instead")
        if method in self._VLLM_WORKER_RPCS:
            raise ValueError(f"collective_rpc({method!r}) is vLLM's worker method, which "
                             f"{self._VLLM_WORKER_RPCS[method]}; nanovllm loads weights with llm.update_weights(): a "
                             "checkpoint directory (llm.config.model: the model's own, as after load_format='dummy'), "
                             "(name, tensor) pairs or a state dict")
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"collective_rpc: args must be a tuple of positional arguments, got {args!r:.60}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"collective_rpc: kwargs must be a dict, got {kwargs!r:.60}")
        with self._exclusive("collective_rpc"):
            self._check_idle("collective_rpc")
            return self.executor.collective_rpc(method, tuple(args or ()), kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block (vLLM's name and arguments), e.g. after changing weights some other way.
        True once reset, as vLLM returns (RL scripts assert it). Requests added with add_request that hold KV blocks
        (running, or mid-prefill) are vLLM's case: with reset_running_requests they are preempted first (a step in
        flight settled, their blocks freed; each is computed again, its tokens so far kept, when it is next
        scheduled), without it nothing changes and the answer is False. reset_connector: there is no KV connector
        to reset."""
        with self._exclusive("reset_prefix_cache"):
            if self.scheduler.block_manager.used_block_ids or self._pending is not None or self._unsettled is not None:
                if not reset_running_requests:
                    logger.warning("reset_prefix_cache(): requests hold KV blocks; nothing reset (pass "
                                   "reset_running_requests=True to preempt them first)")
                    return False
                with self._stepping, self._applied_whole():
                    if self._unsettled is not None:  # (a settle that raised: its tokens come first, as in a step)
                        self._settle(self._unsettled)
                    if self._pending is not None:
                        self._settle()
                    self.scheduler.preempt_all()
            self.scheduler.block_manager.reset_prefix_cache()
            return True

    # ---- RL loops: new weights, and the GPU memory back while training -----------------------------
    def update_weights(self, weights) -> None:
        """Load new weights in place: (name, tensor) pairs, a state dict, or a checkpoint directory, with the
        checkpoint's parameter names (q/k/v and gate/up are fused as when loading; a subset is fine). Every pair,
        name, shape and tensor is checked before any weight changes (ValueError/TypeError, the old weights kept).
        Should the write itself fail after that (out of memory, a worker lost), generate refuses until an
        update_weights sends every weight. Refused while requests are running; the prefix cache is emptied, so
        nothing computed with the old weights is reused. While asleep, the weights are woken up first (after
        sleep(level=2) this is how they come back, and every weight must be sent)."""
        with self._exclusive("update_weights"):
            self._check_idle("update_weights")
            self._check_not_quantized("update_weights")
            weights = _weight_pairs(weights)
            require_all = self._weights_discarded is not None  # nothing, or not all, of the old weights is left
            self.executor.runner.check_weights(weights, require_all)
            if "weights" in self._asleep:
                self._wake_up(["weights"])
            if self.config.tensor_parallel_size > 1 and not isinstance(weights, str):  # they travel pickled
                weights = [(name, tensor.detach().cpu()) for name, tensor in weights]
            # first: should the copy fail half-way, nothing cached under the old weights may be served
            self.scheduler.block_manager.reset_prefix_cache()
            try:
                self.executor.collective_rpc("update_weights", (weights, require_all))
            except BaseException as e:
                self._weights_discarded = (f"an update_weights() failed while writing ({type(e).__name__}: {e}), "
                                           "leaving some weights old and some new")
                raise
            self._weights_discarded = None

    def _check_not_quantized(self, what: str):
        if self.config.quant is not None:
            raise ValueError(f"{what} is not supported with quantized weights (the layers hold fp8 weights and "
                             "scales made at load); start a new LLM with the new checkpoint, or use sleep(level=1)")

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory between generate calls (vLLM's levels): 1 frees the KV cache and the CUDA graphs and
        moves the weights to host memory; 2 frees the weights too (send new ones with update_weights). The prefix
        cache is emptied. Until wake_up(), generate raises."""
        with self._exclusive("sleep"):
            self._check_idle("sleep")
            if isinstance(level, bool) or level not in (1, 2):
                raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights freed), got "
                                 f"{level!r}")
            if level == 2:  # (level 2's weights come back through update_weights)
                self._check_not_quantized("sleep(level=2)")
            if self._asleep:
                raise RuntimeError(f"the engine is already asleep ({', '.join(sorted(self._asleep))}); call "
                                   "wake_up()")
            # the books first: should freeing fail half-way, generate still refuses and wake_up restores what went
            self.scheduler.block_manager.reset_prefix_cache()
            self._asleep = {"weights", "kv_cache"}
            if level == 2:
                self._weights_discarded = "the weights were freed by sleep(level=2)"
            self.executor.collective_rpc("sleep", (level,))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep() freed: tags "weights" and/or "kv_cache" (default both; the weights must be
        awake before the KV cache, whose CUDA graphs read them)."""
        with self._exclusive("wake_up"):
            self._check_idle("wake_up")
            self._wake_up(tags)

    def _wake_up(self, tags: list[str] | None):
        if isinstance(tags, str):
            raise TypeError(f"tags must be a list, e.g. [{tags!r}]")
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; valid: 'weights', 'kv_cache'")
        if "kv_cache" in tags and "weights" not in tags and "weights" in self._asleep:
            raise RuntimeError("wake_up(['kv_cache']) needs the weights awake first: wake_up(['weights'])")
        tags = [t for t in ("weights", "kv_cache") if t in tags and t in self._asleep]
        if tags:
            self.executor.collective_rpc("wake_up", (tags,))
            self._asleep -= set(tags)

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    # ---- requests -------------------------------------------------------------------------------
    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        """A checked request as its first sample (the others in `.forks`), grammar matchers made."""
        token_ids, sampling_params = self.requests.check(prompt, sampling_params)
        block_size = self.config.kvcache_block_size
        seq = Sequence(token_ids, block_size, sampling_params)
        seq.forks = [Sequence(token_ids, block_size, sampling_params, i) for i in range(1, sampling_params.n)]
        seq.prompt, seq.request_id = prompt_parts(prompt)[0], str(next(self._request_ids))
        if sampling_params.bad_words:
            words = self._bad_words_ids(sampling_params.bad_words)
            for sample in (seq, *seq.forks):
                sample.bad_words_ids = words
        if sampling_params.structured_outputs is not None:  # compiled now: a bad spec raises before anything runs
            compiler = self._grammar_compiler()
            for sample in (seq, *seq.forks):
                sample.grammar = compiler.matcher(sampling_params.structured_outputs)
        return seq

    def _set_adapters(self, seqs: list[Sequence], loras: list) -> None:
        """Each request's adapter (a LoRARequest, or None: the base model) on it and its forks, every adapter read
        and checked first (LoRAManager.register: all or none kept)."""
        if all(lora is None for lora in loras):
            return
        if self.scheduler.lora is None:
            raise ValueError("lora_request given, but LoRA is not enabled: create the LLM with enable_lora=True "
                             "(and max_loras, max_lora_rank as needed), or pass lora_request=None")
        for seq, lora, adapter in zip(seqs, loras, self.scheduler.lora.register(loras)):
            if adapter is not None:
                for sample in (seq, *seq.forks):
                    sample.lora_request, sample.lora_id = lora, lora.lora_int_id  # (the caller's request, echoed)
                    sample.cache_salt = cache_salt(adapter.request, adapter.generation)

    # ---- LoRA adapters (vLLM's LLMEngine methods) -------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its first request (ValueError if it cannot be served); True."""
        with self._exclusive("add_lora"):
            if lora_request is None:
                raise TypeError("add_lora needs a LoRARequest, got None")
            if self.scheduler.lora is None:
                raise ValueError("add_lora needs LoRA enabled: create the LLM with enable_lora=True")
            self.scheduler.lora.register([lora_request])
            return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` (its slot is refilled first); False if no adapter has that id."""
        with self._exclusive("remove_lora"):
            self._check_idle("remove_lora")
            return self.scheduler.lora is not None and self.scheduler.lora.remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters the engine knows (added, or named by a request)."""
        return set(self.scheduler.lora.adapters) if self.scheduler.lora is not None else set()

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, as vLLM forms them: the word alone and after a space."""
        ids = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if tokens and tokens not in ids:
                    ids.append(tokens)
        return ids

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and {self.config.model!r} has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.config.eos_token_ids)
        return self._grammars

    def _check_awake(self):
        check_awake(self._asleep, self._weights_discarded)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, lora_request=None, *,
                    stream: bool = False) -> Sequence:
        """Queue one request for step() (under the adapter `lora_request`, or the base model); returns its first
        sample (with n > 1, the others are in `.forks` until its prompt is prefilled, then they run as sequences of
        their own). stream: keep each sample's text up to date as tokens arrive (else only where stop strings need
        it; the text is decoded at the end)."""
        with self._exclusive("add_request"):
            self._check_awake()
            seq = self.make_sequence(prompt, sampling_params)
            self._set_adapters([seq], [lora_request])
            self._add_detokenizers([seq, *seq.forks], stream)
            self.scheduler.add(seq)
            return seq

    def abort_sequences(self, seqs: list[Sequence]) -> None:
        """Finish these sequences now (finish_reason "abort"), freeing their KV blocks; a step in flight that holds
        them leaves them as they are (finished sequences take no tokens). With nothing left queued the engine is idle
        at once (sleep, update_weights and reset_prefix_cache take it)."""
        with self._exclusive("abort_request"):
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            self._drop_useless_step()

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One scheduler step. Returns the sequences that received a token (check `.is_finished`) and
        the number of tokens computed (positive: prefill tokens, negative: decode sequences); ([], 0) when
        nothing is queued. With async_scheduling, a decode step returns the tokens of the step launched before it."""
        with self._exclusive("step"):
            if self.is_finished():
                return [], 0
            with self._applied_whole():
                return self._step()

    @contextmanager
    def _applied_whole(self):
        self._apply_whole = True
        try:
            yield
        finally:
            self._apply_whole = False

    def _step(self) -> tuple[list[Sequence], int]:
        with self._stepping:  # (exit() from another thread waits for this step before tearing down)
            if self._exclusive.closed:  # (exit() from another thread: the executor is gone)
                raise self._exclusive.shut_down_meanwhile()
            return self._step_guarded()

    def _step_guarded(self) -> tuple[list[Sequence], int]:
        try:
            return self._step_once()
        except BaseException as e:
            if self._exclusive.closed and isinstance(e, Exception):  # (a KeyboardInterrupt stays one)
                raise self._exclusive.shut_down_meanwhile() from e
            if self.scheduler.lora is not None:  # a slot's load may not have run: refill before using any
                self.scheduler.lora.forget()
            raise

    def _step_once(self) -> tuple[list[Sequence], int]:
        if self.config.async_scheduling:
            step = self._step_async()
            self._drop_useless_step()  # (settling a step may have ended the last sequence the next one computes)
            return step
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise _nothing_to_schedule()
        return self._apply(batch, self._run_batch(batch)), _num_tokens(batch)

    def _run_batch(self, batch: ScheduledBatch) -> StepOutput:
        """executor.run; should it fail, a prefill's scheduling is undone, so that step() after the error computes
        the prompts again (a failed decode step leaves nothing to undo: it runs again as it was)."""
        try:
            return self.executor.run(batch)
        except BaseException:
            if batch.is_prefill:
                self.scheduler.undo_prefill(batch)
            raise

    def _step_async(self) -> tuple[list[Sequence], int]:
        """The overlap loop: launch decode step N+1, then settle step N (read its tokens, postprocess), so the host
        schedules and prepares N+1 while the device computes N. N+1 takes the inputs N sampled on the device;
        placeholders stand for them in the sequences until N is settled. A sequence that N ends still runs
        (uselessly) in N+1."""
        if self._unsettled is not None:
            unsettled = self._unsettled
            return self._settle(unsettled), _num_tokens(unsettled.batch)
        pending, scheduler = self._pending, self.scheduler
        if pending is not None and scheduler.can_prefill():  # a prefill comes next: it needs the real tokens
            return self._settle(), _num_tokens(pending.batch)
        batch = scheduler.schedule()
        if not batch.seqs:
            if pending is not None:
                return self._settle(), _num_tokens(pending.batch)
            raise _nothing_to_schedule()
        if batch.is_prefill:  # (nothing is pending: waiting sequences made us settle above)
            return self._apply(batch, self._run_batch(batch)), _num_tokens(batch)
        launched = self.executor.launch(batch, pending)  # N+1's forward pass is queued
        settled = None
        if pending is not None and any(seq.grammar is not None or seq.bad_words_ids for seq in batch.rows):
            # N+1's grammar bitmask or bad words need N's tokens: settle N first (tensor parallelism: the workers wait
            # for N+1's tokens meanwhile, so a failure here shuts them down)
            settled = self.executor.between_launch_and_sample(self._settle)
        self._pending = self.executor.sample(launched)
        for seq in batch.seqs:
            if not seq.is_finished:  # (settling N may have just ended it: nothing more to hold a place for)
                seq.append_token(PENDING_TOKEN)
        if pending is not None and settled is None:
            settled = self._settle(pending)
        return settled or [], _num_tokens(batch)

    def _drop_useless_step(self):
        """Async scheduling: with no sequence queued, the step in flight computes only finished ones (ended by a
        stop, or aborted, after it was launched), writing only their freed blocks: it is dropped, as _run drops one,
        so the engine is idle at once (is_finished(); sleep, update_weights and reset_prefix_cache take it).
        Its device work stays queued, and nothing later can change what it reads: all of it is on the one stream,
        ahead of any later step's copies and kernels, and its host buffers are either pinned tensors of its own
        (the caching host allocator reuses one only once its copy is done) or StaticInputs' images (each waited
        for before it is written again)."""
        if self.scheduler.is_finished():
            self._pending = self._unsettled = None

    def _settle(self, step=None) -> list[Sequence]:
        """Wait for a launched step's tokens and apply them."""
        if step is None or step is self._pending:
            step, self._pending = self._pending, None
        try:
            out = self.executor.settle(step)
        except BaseException:
            self._unsettled = step
            raise
        self._unsettled = None
        return self._apply(step.batch, out)

    def _apply(self, batch: ScheduledBatch, out: StepOutput) -> list[Sequence]:
        with interrupt_after() if self._apply_whole else nullcontext():
            updated = self.scheduler.postprocess(batch, out.token_ids, out.logprobs, out.prompt_logprobs)
            self._advance_grammars(updated)
            self._update_texts(updated)
        return updated

    def _advance_grammars(self, seqs: list[Sequence]):
        """Structured outputs: each matcher takes its sequence's new token. A matcher that terminates (it accepted a
        stop token where its grammar may end) finishes its request with "stop", even with ignore_eos."""
        constrained = [seq for seq in seqs if seq.grammar is not None]
        if not constrained:
            return
        matchers, tokens = [seq.grammar.matcher for seq in constrained], [seq.new_token for seq in constrained]
        reasons = accept_tokens(matchers, tokens, self._grammar_threads)
        for seq, reason in zip(constrained, reasons):
            if reason is None:
                continue
            if reason == "error":  # its constraint allowed nothing more (fill_bitmasks): the answer cannot go on
                logger.warning("sequence %d: its constraint allows no continuation of the text so far; the request "
                               "ends with finish_reason 'error'", seq.seq_id)
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
            seq.finish_reason = reason

    def _update_texts(self, seqs: list[Sequence]):
        for seq in seqs:
            if seq.detokenizer is not None:
                self._update_text(seq)

    def _update_text(self, seq: Sequence):
        """Incremental text for streaming and stop strings; finishes the sequence on a stop string."""
        detok = seq.detokenizer
        if _stopped_by_token(seq):  # (vLLM's: the stop token's text stays out, as a stop string's does)
            delta = detok.flush()
        else:
            delta = detok.add(seq.new_token)
            if seq.is_finished:
                delta += detok.flush()
        stops = seq.sampling_params.stop_strings
        # the detokenizer holds exactly the settled completion tokens (async scheduling may have appended more);
        # as in vLLM, a stop string counts only where it ends in text of the tokens past the min_tokens-th
        if len(detok.token_ids) <= seq.sampling_params.min_tokens:
            detok.searched = len(detok.text)
        if not stops or len(detok.text) == detok.searched:
            return
        hit = find_stop(detok.text, len(detok.text) - detok.searched, stops)
        detok.searched = len(detok.text)
        if hit is not None:
            at, stop = hit
            # the returned text ends before the stop string (vLLM's include_stop_str_in_output: after it)
            detok.text = detok.text[:at + len(stop) if seq.sampling_params.include_stop_str_in_output else at]
            if not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            seq.finish_reason, seq.stop_reason = "stop", stop

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._pending is None and self._unsettled is None

    def _text(self, seq: Sequence) -> str:
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        sp = seq.sampling_params
        if self.tokenizer is None or not sp.detokenize:
            return ""
        ids = seq.completion_token_ids
        return decode_after(self.tokenizer, seq.text_context, ids[:-1] if _stopped_by_token(seq) else ids,
                            skip_special_tokens=sp.skip_special_tokens, **_spaces(sp))

    def _logprobs(self, entries: list[dict | None], detokenize: bool) -> list[dict[int, Logprob] | None]:
        """The runner's Logprob dicts, already vLLM's shape (the k most likely in order, rank 1 to k, then the chosen
        token where it is not among them), each Logprob given its token's text when `detokenize`; a FlatLogprobs
        (SamplingParams.flat_logprobs) as a copy with the texts."""
        if isinstance(entries, FlatLogprobs):
            out = entries.copy()
            if detokenize and self.tokenizer is not None:
                texts, decode = self._token_texts, self.tokenizer.decode
                out.decoded_tokens = [texts[t] if t in texts else texts.setdefault(t, decode([t]))
                                      for t in out.token_ids]
            return out
        if detokenize and self.tokenizer is not None:
            texts = self._token_texts
            for entry in entries:
                for t, logprob in entry.items() if entry is not None else ():
                    text = texts.get(t)
                    if text is None:
                        text = texts[t] = self.tokenizer.decode([t])
                    logprob.decoded_token = text
        return list(entries)  # (the sequence's own list grows while it runs)

    def _sample_output(self, seq: Sequence) -> CompletionOutput:
        sp = seq.sampling_params
        logprobs = cumulative = None
        if sp.logprobs is not None:
            logprobs = self._logprobs(seq.logprobs, sp.detokenize)
            cumulative = sum(d[t] for d, t in zip(seq.logprobs, seq.completion_token_ids))
        return CompletionOutput(seq.sample_index, self._text(seq), seq.completion_token_ids, cumulative, logprobs,
                                seq.finish_reason, seq.stop_reason)

    def _output(self, samples: list[Sequence]) -> RequestOutput:
        """One prompt's result: every sample, and what the prompt shares."""
        first = samples[0]
        sp = first.sampling_params
        prompt_logprobs = self._logprobs(first.prompt_logprobs, sp.detokenize) \
            if sp.prompt_logprobs is not None else None
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, prompt_logprobs,
                             [self._sample_output(seq) for seq in samples], True,
                             max(first.num_prefix_hit_tokens, 0), lora_request=first.lora_request)

    def _make_requests(self, prompts, sampling_params, stream: bool, lora_request=None) -> list[list[Sequence]]:
        """Each prompt's samples (n sequences; the first carries the others as forks until its prefill). Every
        request is checked before any is queued, so a bad one leaves the engine untouched."""
        if self._exclusive.closed:
            raise RuntimeError("this LLM has been shut down")
        self._check_awake()
        prompts, sampling_params, loras = as_request_lists(
            prompts, self.default_sampling_params if sampling_params is None else sampling_params, lora_request)
        firsts = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        self._set_adapters(firsts, loras)  # (after every prompt's checks: a refused call registers no adapter)
        requests = [[seq, *seq.forks] for seq in firsts]
        for samples in requests:
            self._add_detokenizers(samples, stream)
        return requests

    def _add_detokenizers(self, samples: list[Sequence], stream: bool):
        """Text while generating, for a stream's deltas or to find stop strings (without one a stop string is never
        seen and the request runs on to its length)."""
        sp = samples[0].sampling_params
        if (stream or sp.stop_strings) and self.tokenizer is not None and sp.detokenize:
            for seq in samples:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens,
                                                         sp.spaces_between_special_tokens, seq.text_context)

    def _run(self, requests: list[list[Sequence]], use_tqdm: bool) -> Iterator[list[Sequence]]:
        """(Under _exclusive.) Drive the engine until every request is done, yielding the sequences updated by each
        step. If the caller stops early or a step fails, unfinished sequences are aborted."""
        self._check_awake()  # (a stream may have been made before a sleep())
        if not self.scheduler.is_finished():
            raise RuntimeError("generate() called while other requests are still running (requests added with "
                               "add_request and not finished)")
        seqs = [seq for samples in requests for seq in samples]
        for samples in requests:
            self.scheduler.add(samples[0])
        # the bar counts output tokens: at most max_tokens a sequence, the rest counted when it finishes early
        bar = tqdm(total=sum(seq.max_tokens for seq in seqs), desc="Generating", unit="tok", dynamic_ncols=True,
                   disable=not use_tqdm)
        prefill_tput = decode_tput = 0.0
        try:
            while not self.is_finished():
                t = perf_counter()
                updated, num_tokens = self._step()
                dt = perf_counter() - t
                if num_tokens > 0:
                    prefill_tput = num_tokens / dt
                else:
                    decode_tput = -num_tokens / dt
                if use_tqdm:
                    bar.set_postfix(prefill=f"{prefill_tput:.0f}tok/s", decode=f"{decode_tput:.0f}tok/s",
                                    refresh=False)
                    bar.update(sum(1 + (seq.max_tokens - seq.num_completion_tokens if seq.is_finished else 0)
                                   for seq in updated))
                yield updated
        finally:
            bar.close()
            # steps still in flight only touch these sequences' (now freed) blocks
            self._pending = self._unsettled = None
            for seq in seqs:  # leave the engine clean for the next call
                if not seq.is_finished:
                    self.scheduler.abort(seq)

    def generate(self, prompts: Prompt | list[Prompt] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
                 stream: bool = False, *, lora_request=None, prompt_token_ids=None, priority=None,
                 tokenization_kwargs=None) -> list[RequestOutput] | Iterator[dict]:
        """Generate for every prompt (a str, token ids, a TextPrompt / TokensPrompt dict, or a list of them).
        Returns one RequestOutput per prompt, in order (vLLM's: request_id, prompt, prompt_token_ids,
        prompt_logprobs, outputs with every sample's CompletionOutput, num_cached_tokens). It also reads as
        nano-vllm's dict: out["text"], out["token_ids"] of the first sample. With stream=True, returns an iterator
        of per-step deltas instead (see `stream`). lora_request: a LoRARequest for every prompt, or one per prompt
        (None: the base model), with enable_lora. prompt_token_ids: older vLLM's keyword for token-id prompts;
        priority: None or 0s only; tokenization_kwargs: None or {} only."""
        prompts = call_prompts(prompts, prompt_token_ids, priority, tokenization_kwargs)
        if stream:
            return self.stream(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        with self._exclusive("generate"):
            requests = self._make_requests(prompts, sampling_params, False, lora_request)
            run = self._run(requests, use_tqdm)
            try:
                for _ in run:
                    pass
            finally:
                run.close()
            return [self._output(samples) for samples in requests]

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
               use_tqdm: bool = False, lora_request=None) -> Iterator[dict]:
        """Yield results as they are produced: one dict per sequence per step with "index" (the prompt's
        position), "sample_index" (which of its n samples), "text" (new text), "token_ids" (new token ids),
        "finished" and "finish_reason" (and "logprobs" for the new tokens when asked). Concatenated, each sample's
        deltas equal its generate() output.
        Requests are checked here, when stream() is called. The stream holds the engine from its first item until it
        is exhausted or closed: meanwhile another call (another stream's first item included) raises RuntimeError."""
        requests = self._make_requests(prompts, sampling_params, True, lora_request)
        return Stream(lambda: self._stream(requests, use_tqdm))

    def _stream(self, requests: list[list[Sequence]], use_tqdm: bool) -> Iterator[dict]:
        with self._exclusive("stream"):  # (entered at the first next(): creating a stream holds nothing)
            # its adapters once more: a remove_lora since stream() forgot one (read again now) or gave its id to
            # another adapter (ValueError), which the stream's requests would otherwise have run under
            firsts = [samples[0] for samples in requests]
            self._set_adapters(firsts, [seq.lora_request for seq in firsts])
            yield from self._stream_items(requests, use_tqdm)

    def _stream_items(self, requests: list[list[Sequence]], use_tqdm: bool) -> Iterator[dict]:
        deltas = StreamDeltas(self, requests)
        run = self._run(requests, use_tqdm)
        try:
            for updated in run:
                yield from deltas(updated)
        finally:  # a stream closed early aborts its requests now, not whenever the inner generator is collected
            run.close()


class StreamDeltas:
    """What a step adds to each updated sequence, as stream() yields it: the prompt's index, which sample, the new
    text (holding back what may still become a stop string) and token, whether it finished."""

    def __init__(self, engine: LLMEngine, requests: list[list[Sequence]]):
        self.engine = engine
        self.index = {seq.seq_id: i for i, samples in enumerate(requests) for seq in samples}
        self.emitted = dict.fromkeys(self.index, 0)  # characters of text already yielded

    def __call__(self, updated: list[Sequence]) -> list[dict]:
        items = []
        for seq in updated:
            text, sp = self.engine._text(seq), seq.sampling_params
            end = len(text) if seq.is_finished else \
                len(text) - stop_holdback(text, sp.stop_strings, sp.include_stop_str_in_output)
            start = self.emitted[seq.seq_id]
            self.emitted[seq.seq_id] = max(start, end)
            item = {"index": self.index[seq.seq_id], "sample_index": seq.sample_index, "text": text[start:end],
                    "token_ids": [seq.new_token], "finished": seq.is_finished, "finish_reason": seq.finish_reason}
            if seq.sampling_params.logprobs is not None:
                item["logprobs"] = seq.logprobs[-1:]
            items.append(item)
        return items
