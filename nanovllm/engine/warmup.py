"""Warm-ups on CUDA: one max-size step before the KV cache is sized (its activation peak is what the cache must
leave free), and one small prefill per Triton kernel variant, so no JIT lands in the first real steps; each first
run once with its Triton kernels compiled in parallel (compile_ahead); and a tally of the Triton compiles behind
them, for the start-up log."""
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import reset_context
from nanovllm.sampling.sampler import SamplingTensors

COMPILE_THREADS = 16  # at most this many Triton compiles at once (each is one CPU thread, mostly outside the GIL)


@dataclass
class CompileTally:
    compiled: int = 0  # kernels compiled (not found in Triton's on-disk cache)
    seconds: float = 0.0  # their compile times added up, as Triton measures them (several run at once)
    cached: int = 0  # kernels loaded from the on-disk cache
    counted: bool = True  # False: this Triton has no compilation listener (before 3.4)

    def __str__(self):
        if not self.counted:
            return "Triton compiles not counted (no compilation listener in this Triton)"
        return (f"Triton {self.compiled} kernels compiled ({self.seconds:.1f}s of compile time), {self.cached} "
                f"from cache")


@contextmanager
def counting_compiles():
    """Yields a CompileTally of the Triton kernels compiled or loaded from disk meanwhile (Triton's compilation
    listener). A listener set before is called too, and put back after unless another replaced ours meanwhile. The
    tally never fails a compile: an event it cannot read is left uncounted."""
    tally = CompileTally()
    lock = threading.Lock()  # compiles report from compile_ahead's threads
    try:
        from triton import knobs
        before = knobs.compilation.listener
    except (ImportError, AttributeError):
        knobs = None
    if knobs is None:  # (outside the except: an error in the block is not chained to this one)
        tally.counted = False
        yield tally
        return

    def listen(**kw):
        try:
            with lock:
                if kw["cache_hit"]:
                    tally.cached += 1
                else:
                    tally.compiled += 1
                    tally.seconds += kw["times"].total / 1e6  # microseconds
        except Exception:
            pass
        if before is not None:
            before(**kw)
    knobs.compilation.listener = listen
    try:
        yield tally
    finally:
        if knobs.compilation.listener is listen:
            knobs.compilation.listener = before


_hashing_triton: threading.Thread | None = None
_compiling_ahead = threading.Lock()  # (JITFunction.run is patched for the whole process)


def start_hashing_triton():
    """Triton keys its compile cache by a hash of its own sources and its 0.5 GB library, which the first compile of
    a process reads (before that compile can start; about a second on a fresh machine). Started in the background
    as the engine loads its model; compile_ahead waits for it."""
    global _hashing_triton
    if _hashing_triton is not None:
        return

    def hash_triton():
        try:
            from triton.runtime.cache import triton_key
        except ImportError:
            try:
                from triton.compiler.compiler import triton_key
            except ImportError:
                return
        try:
            triton_key()  # (cached for the process)
        except Exception:
            pass  # (the compile that needs it raises it again, where it is seen)
    _hashing_triton = threading.Thread(target=hash_triton, name="triton-key", daemon=True)
    _hashing_triton.start()


def _launch_key(fn, args: tuple, kwargs: dict):
    """A launch's arguments as far as they can change what Triton compiles, told apart more finely than Triton's
    own key (tensors by dtype and address modulo 16, anything else by value), so that a launch seen before in a
    compile pass has nothing new to compile. Skipping it matters in Triton 3.6, where a launch whose kernel is
    still compiling costs about 0.5 ms of host time. None when some argument has no hashable value."""
    def part(a):
        return ("tensor", a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else (type(a), a)
    try:
        key = (fn, tuple(part(a) for a in args),
               tuple(sorted((k, part(v)) for k, v in kwargs.items() if k not in ("grid", "warmup"))))
        hash(key)
    except TypeError:
        return None
    return key


def compile_ahead(fn: Callable[[], object]):
    """Runs fn with every Triton kernel launch in it turned into a compile of that kernel, in a thread pool (Triton's
    AsyncCompileMode), and waits for the compiles (raising a compile's error). No kernel runs. The warm-ups run their
    forward passes so, then for real: otherwise a fresh machine compiles a few dozen kernels one after another, most
    of a cold start (measured: docs/kernels.md). What is not a Triton kernel runs as usual, on garbage where a skipped
    kernel's output feeds it, so fn must index nothing by a kernel's output (the model's forward and logits do not).
    Only the calling thread's launches turn into compiles; one compile_ahead runs at a time in a process. Does nothing
    (fn does not run) with a Triton older than 3.5, which has no AsyncCompileMode: kernels then compile at their first
    launch, one at a time. Inside the caller's own AsyncCompileMode fn runs as a plain pass (so that tensor-parallel
    ranks still run the same collectives)."""
    try:
        import triton
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
        mode = triton.AsyncCompileMode
    except (ImportError, AttributeError):
        return
    if _async_compile.active_mode.get() is not None:
        fn()
        return
    if _hashing_triton is not None:
        _hashing_triton.join()
    with _compiling_ahead:
        launch, caller, seen = JITFunction.run, threading.get_ident(), set()

        def compile_only(self, *args, **kwargs):
            if threading.get_ident() != caller:  # another thread's launch runs as usual
                return launch(self, *args, **kwargs)
            key = _launch_key(self, args, kwargs)
            if key in seen:  # (the next layers' launches: nothing new to compile)
                return None
            if key is not None:
                seen.add(key)
            kwargs["warmup"] = True  # Triton's warm-up: specialize and compile (here: submit the compile), no launch
            return launch(self, *args, **kwargs)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        pool = ThreadPoolExecutor(max(1, min(COMPILE_THREADS, cpus)), thread_name_prefix="triton-compile")
        compiling = mode(pool)
        try:
            with pool, compiling:
                JITFunction.run = compile_only
                try:
                    fn()
                finally:
                    JITFunction.run = launch
        finally:
            if _async_compile.active_mode.get() is compiling:  # (Triton 3.5-3.6 leave it on after a failed compile)
                _async_compile.active_mode.set(None)


def _prefill_batch(seqs: list[Sequence]) -> ScheduledBatch:
    return ScheduledBatch(seqs, True, [seq.num_tokens for seq in seqs])


def prefill(runner, seqs: list[Sequence]):
    runner.run(_prefill_batch(seqs))


def forward(runner, seqs: list[Sequence]):
    """The model's forward pass and logits of a prefill step, unsampled (for compile_ahead)."""
    try:
        runner.run_model(runner.prepare(_prefill_batch(seqs)))
    finally:
        reset_context()


def _sample(runner):
    """Sampling for the largest decode batch and for one row (its race kernel compiles apart); with the compiled
    sampler, the kernels of seeded rows and of penalties too."""
    cfg = runner.config
    logits = torch.zeros(cfg.max_num_seqs, cfg.hf_config.vocab_size, dtype=cfg.torch_dtype, device=runner.device)
    temperatures = torch.ones(cfg.max_num_seqs, device=runner.device)
    runner.sampler(logits, SamplingTensors(temperatures), runner.generator)
    runner.sampler(logits[:1], SamplingTensors(temperatures[:1]), runner.generator)
    if runner.sampler.race_draws:
        _sampler_kernels(logits, temperatures)


def _sampler_kernels(logits: torch.Tensor, temperatures: torch.Tensor):
    """The race on float32 logits (a batch with a logits processor or a filter converts them) and keyed for seeded
    rows, for the batch and one row; seeded rows' draws by token id (top-k / top-p); the three penalty variants;
    the logprobs kernel on both types. Each called once on zeros."""
    from nanovllm.kernels.penalties import apply_penalties
    from nanovllm.kernels.race import exp_draws, race
    rows, vocab = logits.shape
    device = logits.device
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    keys, streams = torch.zeros(rows, dtype=torch.int64, device=device), torch.ones(rows, dtype=torch.int64,
                                                                                    device=device)
    floats = logits.float()
    for x, keyed in ((logits, True), (floats, False), (floats, True)):
        for n in (rows, 1):
            race(x[:n], temperatures[:n], seed=seed, **(dict(keys=keys[:n], streams=streams[:n]) if keyed else {}))
    from nanovllm.kernels.logprobs import logprob_stats
    for x in (logits, floats):  # logprobs: one kernel for every k (16-bit logits; float32 after a processor)
        logprob_stats(x, 1)
    ids = torch.zeros(rows, 20, dtype=torch.int64, device=device)  # (the candidate count is not specialized on)
    exp_draws(seed, ids.shape, ids, keys, streams)
    lines, one = torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device)
    seen, counts = torch.zeros(1, vocab, dtype=torch.bool, device=device), torch.zeros(1, vocab, device=device)
    for rep, add in ((True, False), (False, True), (True, True)):
        apply_penalties(floats[:1], lines, seen, counts, one if rep else None, one if add else None,
                        one if add else None)


def _lora_slot(runner) -> int:
    """With enable_lora, warm-ups run under slot 0 (zeros until an adapter is loaded: no update), so the LoRA
    kernels compile here and their buffers count in the activation peak."""
    return 0 if runner.lora is not None else -1


def warmup(runner):
    """One prefill as large as a step can be, and sampling for the largest decode batch; on CUDA their Triton
    kernels compiled ahead, in parallel.

    The KV cache is not allocated yet, so the measured peak holds only weights and activations. (CUDA runs it;
    the tests run it on CPU too, at the same point of the runner's start.)"""
    cfg = runner.config
    seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
    num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
    seqs = [Sequence([0] * seq_len, runner.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = seq_len
        seq.lora_slot = _lora_slot(runner)
    sample = runner.rank == 0

    def forward_passes():
        forward(runner, seqs)
        if sample:  # (nothing indexes by the race's tokens, which come out unused)
            _sample(runner)
    if runner.is_cuda:
        rng = runner.generator.get_state()  # (the pass draws a seed: the engine's draws stay as they were)
        compile_ahead(forward_passes)
        runner.generator.set_state(rng)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    prefill(runner, seqs)
    if sample:
        _sample(runner)
    if runner.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# The Triton prefill kernel is compiled per query tile (16 rows for the longest query up to 16 tokens, else the
# full tile) and per path (packed K/V, or K/V read through block tables). Each variant JITs once per machine;
# warming them all up at start keeps that out of the first real steps (compiled mid-run, one stalls its step for
# most of a second).
PREFILL_QUERY_LENS = (16, 128)


def prefill_variants(runner) -> list[list[Sequence]]:
    """Small prefills at every query tile size, without history and over cached history (blocks from 0 up,
    which hold nothing yet)."""
    batches = []
    for q_len in PREFILL_QUERY_LENS:
        fresh = Sequence([0] * q_len, runner.block_size)  # owns no cache: nothing is written
        fresh.num_scheduled_tokens = q_len
        fresh.lora_slot = _lora_slot(runner)
        batches.append([fresh])
        history = Sequence([0] * (16 + q_len), runner.block_size)
        if runner.num_kvcache_blocks >= history.num_blocks:
            history.block_table = list(range(history.num_blocks))
            history.num_cached_tokens, history.num_scheduled_tokens = 16, q_len
            history.lora_slot = _lora_slot(runner)
            batches.append([history])
    return batches
