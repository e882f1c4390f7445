"""Repetition, presence and frequency penalties in one pass over float32 logits (sampling/logits_processors.py's
PenaltiesProcessor.apply_torch is the reference). Each program reads its row's history through the row index, in
place in the processor's buffers: the torch form first gathers the batch's [batch, vocab] seen flags and counts,
then makes about ten [batch, vocab] float32 passes (at batch 256, about 4 GB of memory traffic a step)."""
import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _penalties_kernel(logits_ptr, out_ptr, rows_ptr, seen_ptr, counts_ptr, rep_ptr, pres_ptr, freq_ptr,
                      stride_l, stride_o, stride_h, vocab,
                      REP: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    history = tl.load(rows_ptr + row).to(tl.int64) * stride_h  # this row's line of the seen / counts buffers
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=0.0)
    if REP:  # seen tokens: positive logits divided by the penalty, negative ones multiplied (as HF / CTRL)
        p = tl.load(rep_ptr + row)
        seen = tl.load(seen_ptr + history + offs, mask=mask, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, p), x * p), x)
    if ADD:  # presence once for any output occurrence, frequency per occurrence (as OpenAI)
        c = tl.load(counts_ptr + history + offs, mask=mask, other=0.0)
        x = x - tl.load(pres_ptr + row) * (c > 0).to(tl.float32)
        x = x - tl.load(freq_ptr + row) * c
    tl.store(out_ptr + row * stride_o + offs, x, mask=mask)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    repetition: torch.Tensor | None, presence: torch.Tensor | None,
                    frequency: torch.Tensor | None) -> torch.Tensor:
    """logits [batch, vocab] float32; rows [batch]: each row's line of seen [lines, vocab] bool and counts [lines,
    vocab] float32; repetition [batch] (None: no row has one), presence and frequency [batch] (both None or both
    given) -> a new penalized [batch, vocab] float32 tensor."""
    batch, vocab = logits.shape
    if seen.shape != counts.shape or seen.size(1) != vocab or not (seen.is_contiguous() and counts.is_contiguous()):
        raise ValueError(f"seen and counts must be contiguous [lines, {vocab}] buffers, got {tuple(seen.shape)} and "
                         f"{tuple(counts.shape)}")
    if (presence is None) != (frequency is None):
        raise ValueError("presence and frequency go together: pass both or neither")
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    if not batch:
        return out
    add = presence is not None
    _penalties_kernel[(batch, triton.cdiv(vocab, BLOCK))](
        logits, out, rows, seen.view(torch.uint8), counts, repetition if repetition is not None else logits,
        presence if add else logits, frequency if add else logits, logits.stride(0), out.stride(0), seen.stride(0),
        vocab, REP=repetition is not None, ADD=add, BLOCK=BLOCK, num_warps=8)
    return out
