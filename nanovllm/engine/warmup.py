"""Warm-ups on CUDA: one max-size step before the KV cache is sized (its activation peak is what the cache must
leave free), and one small prefill per Triton kernel variant, so no JIT lands in the first real steps; and a tally
of the Triton compiles behind them, for the start-up log."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors


@dataclass
class CompileTally:
    compiled: int = 0  # kernels compiled (not found in Triton's on-disk cache)
    seconds: float = 0.0  # their compile time, as Triton measures it
    cached: int = 0  # kernels loaded from the on-disk cache
    counted: bool = True  # False: this Triton has no compilation listener (before 3.4)

    def __str__(self):
        if not self.counted:
            return "Triton compiles not counted (no compilation listener in this Triton)"
        return f"Triton {self.compiled} kernels compiled in {self.seconds:.1f}s, {self.cached} from cache"


@contextmanager
def counting_compiles():
    """Yields a CompileTally of the Triton kernels compiled or loaded from disk meanwhile (Triton's compilation
    listener). A listener set before is called too, and put back after unless another replaced ours meanwhile. The
    tally never fails a compile: an event it cannot read is left uncounted."""
    tally = CompileTally()
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


def _prefill(runner, seqs: list[Sequence]):
    runner.run(ScheduledBatch(seqs, True, [seq.num_tokens for seq in seqs]))


def warmup(runner):
    """One prefill as large as a step can be, and sampling for the largest decode batch.

    The KV cache is not allocated yet, so the measured peak holds only weights and activations. (CUDA runs it;
    the tests run it on CPU too, at the same point of the runner's start.)"""
    cfg = runner.config
    if runner.is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
    num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
    seqs = [Sequence([0] * seq_len, runner.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = seq_len
    _prefill(runner, seqs)
    if runner.rank == 0:
        vocab = cfg.hf_config.vocab_size
        logits = torch.zeros(cfg.max_num_seqs, vocab, dtype=cfg.torch_dtype, device=runner.device)
        temperatures = torch.ones(cfg.max_num_seqs, device=runner.device)
        runner.sampler(logits, SamplingTensors(temperatures), runner.generator)
        runner.sampler(logits[:1], SamplingTensors(temperatures[:1]), runner.generator)  # batch 1 compiles apart
        del logits
    if runner.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# The Triton prefill kernel is compiled per query tile (16 rows for the longest query up to 16 tokens, else the
# full tile) and per path (packed K/V, or K/V read through block tables). Each variant JITs once per machine;
# warming them all up at start keeps that out of the first real steps (a first bench run paid about 0.9 s for
# one, mid-run).
PREFILL_QUERY_LENS = (16, 128)


def warmup_prefill_variants(runner):
    """Small prefills at every query tile size, without history and over cached history (blocks from 0 up,
    which hold nothing yet)."""
    for q_len in PREFILL_QUERY_LENS:
        fresh = Sequence([0] * q_len, runner.block_size)  # owns no cache: nothing is written
        fresh.num_scheduled_tokens = q_len
        _prefill(runner, [fresh])
        history = Sequence([0] * (16 + q_len), runner.block_size)
        if runner.num_kvcache_blocks >= history.num_blocks:
            history.block_table = list(range(history.num_blocks))
            history.num_cached_tokens, history.num_scheduled_tokens = 16, q_len
            _prefill(runner, [history])
    if runner.is_cuda:
        torch.cuda.synchronize()
