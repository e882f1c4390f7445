"""The sampler's exponential race, argmax(logits / T - log E) per row, in one pass over 16-bit or float32 logits
(layers/sampler.py's race_in_log_space is the reference). One program per row streams the vocabulary; ties go to
the first index, as torch.argmax. The GPU's division and log may differ from torch's in the last bit, so a near-tie
can go the other way than the reference's on the same noise: the distribution is the same.

Without a noise tensor the kernel draws E itself: E = -log(1 - U), U uniform in [0, 1) from Philox (tl.rand) keyed
by the step's seed plus the row, counter the token id. That skips writing and reading a [batch, vocab] float32
tensor of draws (at batch 256, 155 MB each way) and its kernel."""
import torch
import triton
import triton.language as tl


@triton.jit
def _race_kernel(logits_ptr, temps_ptr, noise_ptr, seed_ptr, out_ptr, stride_l, stride_n, vocab, BLOCK: tl.constexpr,
                 DRAW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temps_ptr + row)
    if DRAW:
        seed = tl.load(seed_ptr) + row  # one Philox key per row; the counter is the token id
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if DRAW:
            e = -tl.log(1.0 - tl.rand(seed, offs))  # Exp(1); U = 0 gives E = 0 (that token wins: its arrival is 0)
        else:
            e = tl.load(noise_ptr + row * stride_n + offs, mask=mask, other=1.0)
        score = tl.where(mask, x / t - tl.log(tl.maximum(e, 1e-10)), float("-inf"))
        m = tl.max(score, 0)
        i = tl.min(tl.where(score == m, offs, vocab), 0).to(tl.int64)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_i)


def race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor | None = None,
         seed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [batch, vocab] (any float type), temperatures [batch, 1] or [batch] (> 0), and either noise [batch,
    vocab] float32 Exp(1) draws or seed, an int64 tensor of one element on the logits' device (the kernel draws)
    -> token ids [batch] int64."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        if (noise is None) == (seed is None):
            raise ValueError("race() takes either noise or seed, not both or neither")
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        if noise is not None and noise.stride(-1) != 1:
            noise = noise.contiguous()
        temps = temperatures.reshape(batch).float().contiguous()
        _race_kernel[(batch,)](logits, temps, noise if noise is not None else logits, seed if seed is not None else out,
                               out, logits.stride(0), noise.stride(0) if noise is not None else 0, vocab,
                               BLOCK=4096, DRAW=noise is None, num_warps=8)
    return out
