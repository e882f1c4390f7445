"""Batched sampling: every option is applied to the whole batch with tensors, no per-row Python
loops except for the noise of seeded requests."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.compile import compiled


@dataclass
class SamplingTensors:
    """Per-row sampling options for one step, on the logits' device. Optional parts are None when no
    row in the batch uses them, so the plain path stays a softmax and one argmax."""

    temperatures: torch.Tensor  # [batch] float32; 0: greedy
    any_greedy: bool = True  # host-side flags, so that a batch skips the work none of its rows needs
    all_greedy: bool = False
    max_top_k: int = 1 << 62  # largest top-k of the batch (every row has one), else more than the vocabulary
    vocab_size: int = 0  # for seeded rows' draws (0: the logits' width)
    top_ks: torch.Tensor | None = None  # [batch] int64; vocab size when off
    top_ps: torch.Tensor | None = None  # [batch] float32; 1 when off
    min_ps: torch.Tensor | None = None  # [batch] float32; 0 when off
    repetition: torch.Tensor | None = None  # [batch] float32 (1: off), with seen_mask
    seen_mask: torch.Tensor | None = None  # [batch, vocab] bool: token in prompt or output
    presence: torch.Tensor | None = None  # [batch] float32, with output_counts
    frequency: torch.Tensor | None = None  # [batch] float32
    output_counts: torch.Tensor | None = None  # [batch, vocab] float32: times each token was generated
    penalty_rows: torch.Tensor | None = None  # [batch] rows of the PenaltyState (for its update)
    sampled_rows: torch.Tensor | None = None  # [batch] bool: the row's token is kept (not a prefill chunk)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf (min_tokens)
    generators: list[tuple[int, torch.Generator]] | None = None  # seeded rows and their generators
    num_logprobs: int = -1  # top-k logprobs to return (-1: none)


class Sampler(nn.Module):
    """Exact sampling without multinomial: argmax(p / E) with E ~ Exp(1) picks token i with probability
    p_i (the exponential race). Rows with temperature 0 take the argmax of the processed logits."""

    def __init__(self):
        super().__init__()
        self.race_fn = race_in_log_space

    def use_compiled(self, enabled: bool = True):
        self.race_fn = compiled(race_in_log_space) if enabled else race_in_log_space

    def forward(self, logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None = None):
        """Returns (token ids [batch] int64, logprobs or None). logprobs = (top values [batch, k],
        top ids [batch, k], sampled token's logprob [batch]) from the raw distribution."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, -1) if st.num_logprobs >= 0 else None
        if st.repetition is not None:
            # HF/CTRL repetition penalty on every token seen so far: shrink positive logits, grow negative ones
            penalty = torch.where(st.seen_mask, st.repetition.unsqueeze(1), 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if st.presence is not None:
            logits = logits - st.presence.unsqueeze(1) * (st.output_counts > 0) \
                - st.frequency.unsqueeze(1) * st.output_counts
        if st.banned is not None:
            logits = logits.index_put(st.banned, torch.tensor(float("-inf"), device=logits.device))
        if st.all_greedy:  # nothing to draw: skip the softmax and the noise
            tokens = logits.argmax(-1)
        else:
            temperatures = st.temperatures.clamp(min=1e-5).unsqueeze(1)
            if st.top_ks is not None or st.top_ps is not None or st.min_ps is not None:
                tokens = _sample_filtered(torch.softmax(logits / temperatures, -1), st, generator)
            else:  # the race in log space needs no softmax: argmax(p / E) = argmax(logits / T - log E)
                tokens = self.race_fn(logits, temperatures, _noise(logits, st, generator))
            if st.any_greedy:
                tokens = torch.where(st.temperatures == 0, logits.argmax(-1), tokens)
        if raw_logprobs is None:
            return tokens, None
        top = raw_logprobs.topk(st.num_logprobs, -1) if st.num_logprobs > 0 else None
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, (top.values if top else None, top.indices if top else None, chosen)


def _noise(like: torch.Tensor, st: SamplingTensors, generator, token_ids: torch.Tensor | None = None):
    """Exp(1) draws shaped like `like` [batch, n]; token_ids [batch, n] gives each candidate's vocabulary id
    (None: candidate i is token i). A seeded row draws one Exp(1) per vocabulary id from its own generator,
    so its tokens do not depend on how many candidates the rest of the batch needs."""
    noise = torch.empty(like.shape, device=like.device).exponential_(1, generator=generator)
    for row, gen in st.generators or ():
        draws = torch.empty(st.vocab_size or like.size(1), device=like.device).exponential_(1, generator=gen)
        noise[row] = draws if token_ids is None else draws[token_ids[row]]
    return noise


def race_in_log_space(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T - log E): the exponential race on softmax(logits / T), one fused pass when compiled."""
    return (logits.float() / temperatures - noise.clamp(min=1e-10).log()).argmax(-1)


def _race(probs: torch.Tensor, st: SamplingTensors, generator, token_ids: torch.Tensor | None = None):
    """The exponential race among candidates: argmax(p / E) picks candidate i with probability p_i."""
    noise = _noise(probs, st, generator, token_ids)
    pick = probs.div_(noise.clamp_(min=1e-10)).argmax(-1)
    return pick if token_ids is None else token_ids.gather(1, pick.unsqueeze(1)).squeeze(1)


def _sample_filtered(probs: torch.Tensor, st: SamplingTensors, generator) -> torch.Tensor:
    """top-k, then top-p (over what top-k kept, renormalized), then min-p; then the race among the rest.
    When every row has a top-k, only the max_top_k best candidates are ranked (topk instead of a full sort)."""
    if st.max_top_k < probs.size(1):
        sorted_probs, order = probs.topk(st.max_top_k, -1)
    else:
        sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(sorted_probs.size(1), device=probs.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if st.top_ks is not None:
        remove |= rank >= st.top_ks.unsqueeze(1)
    if st.top_ps is not None:
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        kept = sorted_probs.masked_fill(remove, 0.0)
        mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
        remove |= mass_before >= st.top_ps.unsqueeze(1)
    if st.min_ps is not None:
        remove |= sorted_probs < st.min_ps.unsqueeze(1) * sorted_probs[:, :1]
    remove[:, 0] = False  # the most likely token always stays
    return _race(sorted_probs.masked_fill(remove, 0.0), st, generator, order)
