"""The sampler's exponential race, argmax(logits / T - log E) per row, in one pass over 16-bit or float32 logits
(sampling/sampler.py's race_in_log_space is the reference). Ties go to the first index, as torch.argmax. The GPU's
division and log may differ from torch's in the last bit, so a near-tie can go the other way than the reference's
on the same noise: the distribution is the same.

Without a noise tensor the kernel draws E itself: E = -log(1 - U) (_exp1: accurate for small U too), U uniform in
[0, 1) from Philox keyed by the step's seed plus the row; one Philox call gives four uniforms, so token n takes lane
n % 4 of counter n // 4 (_uniforms). That skips writing and reading a [batch, vocab] float32 tensor of draws (at
batch 256, 155 MB each way) and its kernel. A seeded request's row is keyed by its seed instead, with its stream (the
position its token takes, plus one) in the counter's high 32 bits: its draws depend on neither the batch nor the
step, and never repeat along the sequence. exp_draws writes the same draws as a tensor (for top-k / top-p, which
race among sorted candidates). The kernel then scores in base 2, argmax(logits * log2(e) / T - log2(E *
log2(e))) (the same order: the natural-log score times log2(e), less a constant), with the GPU's one-instruction
log2 (lg2.approx: absolute error about 2^-22 near 1, so E is about 2e-5 off, relatively, where the series for
small U hands over). Each lane of a program's block keeps its own best across the blocks; the program reduces
them once, at the end. (Without these two the race is bound by its arithmetic and per-block reductions, not by
reading the logits. Measured gain: docs/kernels.md.)

A batch under 4 rows a SM splits each row's vocabulary over several programs (one program per row would stream 152k
ids on one SM while the others idle), each keeping its chunk's best; a second kernel picks each row's best chunk. The
draws do not depend on the split (the counter is the token id // 4)."""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.kernels.decode import sm_count

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
PROGRAMS_PER_SM = 4  # a batch under this many rows a SM splits its rows into vocabulary chunks (race_chunks)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # (Triton reads it at import too): no libdevice


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:  # lg2.approx (the interpreter has no libdevice)
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _exp1(u, FAST: tl.constexpr = False):
    """Exp(1) from U uniform in [0, 1) (tl.rand4x: multiples of 2^-31), in base-2 units: E * log2(e) = -log2(1 - U),
    with the series of -log1p(-U) for small U. 1 - U in float32 rounds to 1 for U <= 2^-25, so -log(1 - U) would
    give E = 0 (log E = -inf: that token wins outright) with probability 3e-8 instead of 1e-10: at 150k tokens, up to
    one step in 200. U = 0 stands for its interval [0, 2^-31): E = 2^-32."""
    u = tl.maximum(u, 2.3283064365386963e-10)
    small = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25))) * LOG2E
    return tl.where(u < 0.0078125, small, -_log2(1.0 - u, FAST))


@triton.jit
def _uniforms(key, counter, BLOCK: tl.constexpr):
    """U for BLOCK tokens from token 4 * counter on: token n is lane n % 4 of Philox counter n // 4 (plus the row's
    stream << 32)."""
    u0, u1, u2, u3 = tl.rand4x(key, counter + tl.arange(0, BLOCK // 4))
    return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3))


@triton.jit
def _row_key(seed_ptr, keys_ptr, streams_ptr, row, KEYED: tl.constexpr):
    """(Philox key, the counters' offset) of a row: the step's seed + row; a seeded row's own key and stream << 32."""
    key = tl.load(seed_ptr) + row
    offset = 0
    if KEYED:
        stream = tl.load(streams_ptr + row)
        key = tl.where(stream > 0, tl.load(keys_ptr + row), key)
        offset = stream << 32
    return key, offset


@triton.jit
def _race_kernel(logits_ptr, temps_ptr, noise_ptr, seed_ptr, keys_ptr, streams_ptr, out_ptr, best_ptr, stride_l,
                 stride_n, vocab, span, BLOCK: tl.constexpr, DRAW: tl.constexpr, KEYED: tl.constexpr,
                 SPLIT: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temps_ptr + row)
    if DRAW:
        key, offset = _row_key(seed_ptr, keys_ptr, streams_ptr, row, KEYED)  # the counter is the token id // 4
        scale = LOG2E / t
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's best so far: one reduction at the end
    best_i = tl.zeros([BLOCK], tl.int32)
    lo = chunk * span
    hi = tl.minimum(lo + span, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if DRAW:  # base 2 (the module's docstring)
            score = x * scale - _log2(_exp1(_uniforms(key, offset + start // 4, BLOCK), FAST), FAST)
        else:  # the reference's own score: the same picks as race_in_log_space on the same noise
            score = x / t - tl.log(tl.maximum(tl.load(noise_ptr + row * stride_n + offs, mask=mask, other=1.0), 1e-10))
        take = mask & (score > best)  # strictly: a lane keeps its first index of a tie
        best_i = tl.where(take, offs, best_i)
        best = tl.where(take, score, best)
    m = tl.max(best, 0)
    best_i = tl.min(tl.where(best == m, best_i, vocab), 0).to(tl.int64)  # the first index among the lanes' ties
    best = m
    if SPLIT:
        n = tl.num_programs(1)
        tl.store(best_ptr + row * n + chunk, best)
        tl.store(out_ptr + row * n + chunk, best_i)
    else:
        tl.store(out_ptr + row, best_i)


@triton.jit(do_not_specialize=["chunks"])
def _race_pick_kernel(best_ptr, idx_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    """Each row's winner among its chunks' bests: the first chunk with the highest score (chunks are in index
    order, so ties still go to the first index). CHUNKS bounds the chunk count of any batch (one compile)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    mask = c < chunks
    s = tl.load(best_ptr + row * chunks + c, mask=mask, other=float("-inf"))
    m = tl.max(s, 0)
    first = tl.min(tl.where((s == m) & mask, c, CHUNKS), 0)
    first = tl.where(first < chunks, first, 0)  # (a guard: no chunk equals the max only if a best were NaN)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + first))


def race_chunks(batch: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(chunks per row, tokens per chunk): about four programs per SM in all (so at most 4 x SMs chunks a row),
    chunks of at least 1,024 ids. Four programs a SM rather than two: faster at batches 16-64, about even at 256
    (docs/kernels.md)."""
    sms = sm_count(device)
    if batch >= PROGRAMS_PER_SM * sms:
        return 1, vocab
    chunks = min(triton.cdiv(vocab, 1024), triton.cdiv(PROGRAMS_PER_SM * sms, batch))
    span = triton.cdiv(triton.cdiv(vocab, chunks), 1024) * 1024
    return triton.cdiv(vocab, span), span


def race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor | None = None,
         seed: torch.Tensor | None = None, keys: torch.Tensor | None = None,
         streams: torch.Tensor | None = None) -> torch.Tensor:
    """logits [batch, vocab] (any float type), temperatures [batch, 1] or [batch] (> 0), and either noise [batch,
    vocab] float32 Exp(1) draws or seed, an int64 tensor of one element on the logits' device (the kernel draws);
    with seed, keys and streams [batch] int64 (both or neither) key the rows whose stream is not 0 by their own
    key -> token ids [batch] int64."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if not batch:
        return out
    if (noise is None) == (seed is None):
        raise ValueError("race() takes either noise or seed, not both or neither")
    keyed = _check_keys(keys, streams, batch, seed)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if noise is not None and noise.stride(-1) != 1:
        noise = noise.contiguous()
    temps = temperatures.reshape(batch).float().contiguous()
    chunks, span = race_chunks(batch, vocab, logits.device)
    split = chunks > 1
    idx = torch.empty(batch, chunks, dtype=torch.int64, device=logits.device) if split else out
    best = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device) if split else temps
    seed = seed if seed is not None else out
    _race_kernel[(batch, chunks)](logits, temps, noise if noise is not None else logits, seed,
                                  keys if keyed else seed, streams if keyed else seed, idx, best, logits.stride(0),
                                  noise.stride(0) if noise is not None else 0, vocab, span,
                                  BLOCK=1024 if split else 4096, DRAW=noise is None, KEYED=keyed, SPLIT=split,
                                  FAST=logits.is_cuda and not INTERPRETED, num_warps=4 if split else 8)
    if split:
        bound = triton.next_power_of_2(PROGRAMS_PER_SM * sm_count(logits.device))
        _race_pick_kernel[(batch,)](best, idx, out, chunks, CHUNKS=bound, num_warps=1)
    return out


def _check_keys(keys, streams, batch: int, seed) -> bool:
    if (keys is None) != (streams is None):
        raise ValueError("keys and streams go together: pass both or neither")
    if keys is None:
        return False
    if seed is None:
        raise ValueError("keys and streams key the kernel's own draws: pass seed as well")
    for name, t in (("keys", keys), ("streams", streams)):
        if t.shape != (batch,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor of shape ({batch},), got {t.dtype} "
                             f"{tuple(t.shape)}")
    return True


@triton.jit(do_not_specialize=["n", "stride_i", "stride_o"])  # (one compile for every candidate count)
def _draws_kernel(seed_ptr, keys_ptr, streams_ptr, ids_ptr, out_ptr, n, stride_i, stride_o, KEYED: tl.constexpr,
                  IDS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n
    key, offset = _row_key(seed_ptr, keys_ptr, streams_ptr, row, KEYED)
    if IDS:  # candidate j is token ids[row, j]: its own lane of its own counter
        t = tl.load(ids_ptr + row * stride_i + cols, mask=mask, other=0).to(tl.int64)
        u0, u1, u2, u3 = tl.rand4x(key, offset + t // 4)
        lane = t % 4
        u = tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))
    else:  # candidate j is token j
        u = _uniforms(key, offset + start // 4, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, _exp1(u, FAST) * LN2, mask=mask)  # natural units


def exp_draws(seed: torch.Tensor, shape: tuple[int, int], token_ids: torch.Tensor | None = None,
              keys: torch.Tensor | None = None, streams: torch.Tensor | None = None) -> torch.Tensor:
    """The Exp(1) draws the race kernel makes with the same seed, keys and streams, as a float32 tensor of `shape`
    [batch, n]: entry j of a row is token token_ids[row, j]'s draw (None: token j's)."""
    batch, n = shape
    out = torch.empty(shape, dtype=torch.float32, device=seed.device)
    if not batch or not n:
        return out
    keyed = _check_keys(keys, streams, batch, seed)
    if token_ids is not None:
        if token_ids.shape != (batch, n):
            raise ValueError(f"token_ids must have shape {tuple(shape)}, got {tuple(token_ids.shape)}")
        if token_ids.stride(-1) != 1:
            token_ids = token_ids.contiguous()
    block = 1024
    _draws_kernel[(batch, triton.cdiv(n, block))](
        seed, keys if keyed else seed, streams if keyed else seed, token_ids if token_ids is not None else out, out,
        n, token_ids.stride(0) if token_ids is not None else 0, out.stride(0), KEYED=keyed, IDS=token_ids is not None,
        BLOCK=block, FAST=seed.is_cuda and not INTERPRETED, num_warps=4)
    return out
