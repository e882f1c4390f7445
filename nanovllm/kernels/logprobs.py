"""What a step's logprobs need from the logits, in one read of them: each row's logsumexp and its k largest logits
with their ids (sampling/sampler.py subtracts the one from the others). torch would take a float32 copy of the
logits and run logsumexp and topk over it, at large batches many times the cost of the sampling itself
(docs/kernels.md).

A program streams one chunk of a row (about the race kernel's split, race.race_chunks; the last chunk takes the
remainder, so every chunk holds at least k ids) block by block. It keeps an online maximum and sum of exponentials,
and the chunk's k best so far, seeded with the chunk's first k logits; a block whose values all lie at or below the
k-th best (most blocks, once a few have passed) costs one comparison more, and each value above it replaces the
worst kept one. A small torch merge then takes each row's top k over its chunks' k candidates each (distinct ids,
-inf ones too: a row with fewer than k finite logits, as a grammar's mask leaves, reports the rest as -inf) and
its logsumexp over the chunks' (max, sum). Which of several tied logits make the top k is not specified, as with
torch.topk."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.race import race_chunks

MAX_K = 32  # logprobs=k up to this many take the kernel (vLLM's default cap is 20); more take torch.topk


@triton.jit(do_not_specialize=["k"])  # one compiled kernel for every k (and k = 0: the logsumexp alone)
def _logprob_stats_kernel(logits_ptr, max_ptr, sum_ptr, top_v_ptr, top_i_ptr, stride_l, vocab, span, k,
                          BLOCK: tl.constexpr, KB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    lo = chunk * span
    hi = tl.where(chunk == chunks - 1, vocab, lo + span)  # the last chunk takes the remainder
    base = logits_ptr + row * stride_l
    slots = tl.arange(0, KB)
    used = slots < k
    # seeded with the chunk's first k logits (it holds at least k); slots past k stay +inf, never the worst (k = 0:
    # the worst is +inf and nothing ever enters)
    top_v = tl.load(base + lo + slots, mask=used, other=float("inf")).to(tl.float32)
    top_i = lo + slots
    worst = tl.min(top_v, 0)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < hi
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        if m_new > float("-inf"):  # (a block of -inf alone: nothing to add, and -inf - -inf would be NaN)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        cand = tl.where(inside & (offs >= lo + k) & (x > worst), x, float("-inf"))
        best = tl.max(cand, 0)
        while best > worst:  # the best candidate replaces the worst kept value (the first such slot)
            at = tl.min(tl.where(cand == best, offs, hi), 0)
            slot = tl.min(tl.where(top_v == worst, slots, KB), 0)
            top_v = tl.where(slots == slot, best, top_v)
            top_i = tl.where(slots == slot, at, top_i)
            worst = tl.min(top_v, 0)
            cand = tl.where((offs == at) | (cand <= worst), float("-inf"), cand)
            best = tl.max(cand, 0)
    out = row * chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    tl.store(top_v_ptr + out * KB + slots, top_v, mask=used)
    tl.store(top_i_ptr + out * KB + slots, top_i.to(tl.int64), mask=used)


def logprob_stats(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [batch, vocab] (16-bit or float32), 0 <= k <= min(MAX_K, vocab) -> (logsumexp [batch] float32, the k
    largest logits [batch, k] float32 in descending order, their ids [batch, k] int64); k = 0: (lse, None, None)."""
    batch, vocab = logits.shape
    if not 0 <= k <= min(MAX_K, vocab):
        raise ValueError(f"logprob_stats takes 0 <= k <= {min(MAX_K, vocab)}, got {k}")
    dev = logits.device
    if not batch:
        empty = torch.empty(0, k, device=dev)
        return torch.empty(0, device=dev), (empty if k else None), (empty.long() if k else None)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    span = race_chunks(batch, vocab, dev)[1]  # (at least 1,024 ids, or the whole row)
    chunks = max(1, vocab // span)  # the last chunk takes the remainder: each holds at least min(span, vocab) >= k
    maxes = torch.empty(batch, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxes)
    top_v = torch.empty(batch, chunks * MAX_K, dtype=torch.float32, device=dev)
    top_i = torch.empty(batch, chunks * MAX_K, dtype=torch.int64, device=dev)
    _logprob_stats_kernel[(batch, chunks)](logits, maxes, sums, top_v, top_i, logits.stride(0), vocab, span, k,
                                           BLOCK=1024, KB=MAX_K, num_warps=4)
    # a chunk's sum is relative to its maximum; chunks with nothing finite (-inf, 0) drop out of the logsumexp
    lse = torch.logsumexp(maxes + sums.log(), -1)
    if not k:
        return lse, None, None
    # each chunk's k candidates (slots past k are not written)
    top_v = top_v.view(batch, chunks, MAX_K)[:, :, :k].reshape(batch, -1)
    top_i = top_i.view(batch, chunks, MAX_K)[:, :, :k].reshape(batch, -1)
    top = top_v.topk(k, -1)
    return lse, top.values, top_i.gather(1, top.indices)
