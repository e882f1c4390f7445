"""Batched sampling: every option is applied to the whole batch with tensors. On CUDA a seeded request's draws come
from Philox keyed by its seed (kernels/race.py), the others' from the race kernel's Philox keyed by the step's seed
(or, with top-k / top-p, from the runner's generator); on CPU a seeded request draws from its own torch.Generator, one
row at a time."""
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.layers.context import ToDevice, to_device_packed
from nanovllm.sampling.logits_processors import (
    AllowedTokensProcessor,
    BadWordsProcessor,
    GrammarProcessor,
    LogitBiasProcessor,
    LogitsProcessor,
    MinTokensProcessor,
    PenaltiesProcessor,
)
from nanovllm.sampling.structured_outputs import grammar_threads
from nanovllm.sampling_params import sample_seed

MIN_TEMPERATURE = 1e-5  # the race divides by the temperature: a greedy row's 0 is clamped to this
SEED_BLOCK = 4096  # steps' seeds drawn at once (Sampler._step_seed)
MAX_LOGPROBS_FUSED = 32  # kernels/logprobs.MAX_K (not imported here: that module needs Triton)


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
    processors: list[tuple[LogitsProcessor, object]] = field(default_factory=list)  # with this step's state
    generators: list[tuple[int, torch.Generator]] | None = None  # seeded rows and their generators (not keyed)
    generator_states: list[torch.Tensor] | None = None  # theirs before this step drew (Sampler.rollback)
    # Keyed draws (CUDA), when some row is seeded: each row's Philox key and stream (kernels/race.py). A seeded row's
    # key is its seed and its stream the position its token takes + 1, so its draws depend on neither the batch nor
    # the step; stream 0: an unseeded row, keyed by the step's seed and its row.
    keys: torch.Tensor | None = None  # [batch] int64
    streams: torch.Tensor | None = None  # [batch] int64
    num_logprobs: int = -1  # top-k logprobs to return (-1: none)
    clamped: torch.Tensor | None = None  # [batch] the temperatures clamped away from 0 (prepare: one copy with them)


class Sampler(nn.Module):
    """Exact sampling without multinomial: argmax(p / E) with E ~ Exp(1) picks token i with probability
    p_i (the exponential race). Rows with temperature 0 take the argmax of the processed logits.

    `prepare` turns a step's sequences into SamplingTensors (rank 0 only); `forward` applies the logits
    processors, samples and lets the processors record the new tokens, all on the device."""

    def __init__(self, vocab_size: int = 0, eos_token_ids: list[int] = (), device: torch.device | str = "cpu",
                 triton: bool | None = None, logprobs_mode: str = "raw_logprobs"):
        """triton: the race, penalties and logprobs as Triton kernels (default: on CUDA). Then the race draws its own
        Exp(1) noise from a per-step seed and seeded rows are keyed in Philox (kernels/race.py), not a generator each;
        else the torch race below, their reference. logprobs_mode: vLLM's (config.LOGPROBS_MODES), what `logprobs`
        returns."""
        super().__init__()
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.processed = logprobs_mode.startswith("processed")
        self.as_logits = logprobs_mode.endswith("logits")
        self.keyed = self.race_draws = self.device.type == "cuda" if triton is None else triton
        if self.keyed:
            from nanovllm.kernels.race import race
            self.race_fn = race
        else:
            self.race_fn = race_in_log_space
        self.penalties = PenaltiesProcessor(vocab_size, self.device, fused=self.keyed)
        self.min_tokens = MinTokensProcessor(eos_token_ids)
        self.grammar = GrammarProcessor(grammar_threads(self.device.type))
        # applied in this order (vLLM's), constraints (the grammar) before the logprobs are taken and the others after
        self.processors: list[LogitsProcessor] = [self.grammar, AllowedTokensProcessor(), BadWordsProcessor(),
                                                  self.min_tokens, LogitBiasProcessor(), self.penalties]
        self._seeds, self._seeds_used, self._seeds_from = None, 0, None  # _step_seed's block

    def prepare(self, seqs: list, sampled: list[bool], to_device: ToDevice,
                positions: list[int] | None = None) -> SamplingTensors:
        """Per-row tensors; the optional ones only when some row needs them. sampled[i] is False for a chunk of a
        longer prefill: its token is thrown away, so it must not use up a seeded request's draws. positions[i]:
        where row i's token goes in its sequence (the scheduler's out_index; default: the sequence's length), the
        stream of a seeded row's draws on CUDA."""
        sps = [seq.sampling_params for seq in seqs]
        vocab = self.vocab_size
        temperatures = [sp.temperature for sp in sps]
        temperatures, clamped = to_device_packed(to_device, [temperatures, [max(t, MIN_TEMPERATURE) for t in
                                                                             temperatures]], torch.float32)
        st = SamplingTensors(temperatures, any_greedy=any(sp.greedy for sp in sps),
                             all_greedy=all(sp.greedy for sp in sps), vocab_size=vocab, clamped=clamped)
        if any(sp.needs_filtering for sp in sps):
            if any(sp.top_k > 0 for sp in sps):
                top_ks = [min(sp.top_k, vocab) if sp.top_k > 0 and not sp.greedy else vocab for sp in sps]
                st.top_ks, st.max_top_k = to_device(top_ks, torch.int64), max(top_ks)
            if any(sp.top_p < 1 for sp in sps):
                st.top_ps = to_device([sp.top_p for sp in sps], torch.float32)
            if any(sp.min_p > 0 for sp in sps):
                st.min_ps = to_device([sp.min_p for sp in sps], torch.float32)
        for processor in self.processors:
            state = processor.prepare(seqs, sampled, to_device)
            if state is not None:
                st.processors.append((processor, state))
        seeded = [i for i, (sp, keep) in enumerate(zip(sps, sampled)) if sp.seed is not None and not sp.greedy and keep]
        if seeded and self.keyed:  # sample i of n is keyed by seed + i (as a 64-bit two's complement)
            keys, streams = [0] * len(seqs), [0] * len(seqs)
            for i in seeded:
                key = sample_seed(sps[i].seed, seqs[i].sample_index)
                keys[i] = key - (1 << 64) if key >= 1 << 63 else key
                streams[i] = 1 + (positions[i] if positions is not None else seqs[i].num_tokens)
            st.keys, st.streams = to_device(keys, torch.int64), to_device(streams, torch.int64)
        elif seeded:
            for i in seeded:
                seq = seqs[i]
                if seq.generator is None:  # sample i of n draws from seed + i
                    seq.generator = torch.Generator(device=self.device).manual_seed(
                        sample_seed(sps[i].seed, seq.sample_index))
            st.generators = [(i, seqs[i].generator) for i in seeded]
        st.num_logprobs = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=-1)
        return st

    def forward(self, logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None = None):
        """Returns (token ids [batch] int64, logprobs or None). logprobs = (top values [batch, k], top ids [batch, k],
        sampled token's logprob [batch], its rank [batch]) from the raw distribution (with the grammar's constraint
        applied, as in vLLM: tokens it forbids have logprob -inf), or in a processed logprobs_mode from the one the
        token is drawn from (processed_logits: see that function)."""
        if st.generators:  # (where the seeded rows' draws start: rollback goes back there)
            st.generator_states = [gen.get_state() for _, gen in st.generators]
        filtered = st.top_ks is not None or st.top_ps is not None or st.min_ps is not None
        fused_logprobs = self._fused_logprobs(st.num_logprobs, logits.size(1))
        if (st.num_logprobs >= 0 and not fused_logprobs) or st.processors or filtered:
            logits = logits.float()  # (argmax and the race read 16-bit logits as they are: no float32 copy)
        for processor, state in st.processors:
            if processor.is_constraint:
                logits = processor.apply(logits, state)
        raw = logits if st.num_logprobs >= 0 and not self.processed else None  # (the processors return new tensors)
        for processor, state in st.processors:
            if not processor.is_constraint:
                logits = processor.apply(logits, state)
        kept = None  # (filtered batches: the sorted candidates top-k, top-p and min-p left, for processed logits)
        if st.all_greedy:  # nothing to draw: skip the softmax and the noise
            tokens = logits.argmax(-1)
        else:
            temperatures = (st.clamped if st.clamped is not None else
                            st.temperatures.clamp(min=MIN_TEMPERATURE)).unsqueeze(1)
            # Philox draws keyed by this step's seed and a seeded row's own key: the race kernel's own, or the same
            # as a tensor (exp_draws) where a seeded row needs them outside it; top-k / top-p batches without a
            # seeded row, and CPU batches, draw from the generator
            draws = seed = None
            if st.keys is not None or (self.race_draws and not filtered):
                seed = self._step_seed(generator, logits.device)
            if st.keys is not None:
                from nanovllm.kernels.race import exp_draws
                draws = functools.partial(exp_draws, seed, keys=st.keys, streams=st.streams)
            if filtered:
                kept = _filter(logits, temperatures, st)
                tokens = _race(kept[0], st, generator, kept[1], draws)
            elif self.race_draws:
                tokens = self.race_fn(logits, temperatures, seed=seed, keys=st.keys, streams=st.streams)
            else:  # the race in log space needs no softmax: argmax(p / E) = argmax(logits / T - log E)
                tokens = self.race_fn(logits, temperatures, _noise(logits, st, generator, draws=draws))
            if st.any_greedy:
                tokens = torch.where(st.temperatures == 0, logits.argmax(-1), tokens)
        for processor, state in st.processors:
            processor.update(state, tokens)
        if st.num_logprobs < 0:
            return tokens, None
        if self.processed:
            raw = processed_logits(logits, st, kept)
        return tokens, self.logprobs(raw, st.num_logprobs, tokens)

    def rollback(self, st: SamplingTensors):
        """Undo what sampling with `st` left behind for its requests: the seeded rows' generators go back to where
        its draws started, and the processors forget its tokens (penalties' counts). For a step whose tokens are
        dropped and that is sampled again (a step() that raised after sampling), whose seeded rows must draw the
        same numbers and whose tokens must be counted once. Safe to call twice, and before `forward` ran."""
        if st.generator_states is not None:
            for (_, gen), state in zip(st.generators, st.generator_states):
                gen.set_state(state)
            st.generator_states = None
        for processor, state in st.processors:
            processor.undo(state)

    def _step_seed(self, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """This step's seed for the race's own draws: one element of a block drawn at once, so that a step launches
        no kernel for it (a draw a step would cost a kernel and its gap, about 3 us). Every other element is used, so
        each seed starts 16-byte aligned: Triton compiles a kernel per pointer alignment."""
        if self._seeds is None or self._seeds_used == SEED_BLOCK or self._seeds_from is not generator:
            self._seeds = torch.randint(1 << 62, (SEED_BLOCK, 2), generator=generator, device=device)
            self._seeds_used, self._seeds_from = 0, generator
        self._seeds_used += 1
        return self._seeds[self._seeds_used - 1, :1]

    def _fused_logprobs(self, k: int, vocab: int) -> bool:
        """Logprobs from one kernel pass over the logits as they are (CUDA), else torch over float32."""
        return self.race_draws and 0 <= k <= min(MAX_LOGPROBS_FUSED, vocab)

    def logprobs(self, raw: torch.Tensor, k: int, targets: torch.Tensor):
        """(top k logprobs [rows, k] or None for k = 0, their ids, the targets' logprobs [rows], the targets' ranks
        [rows]) of raw logits [rows, vocab], each as logit - logsumexp (no [rows, vocab] log_softmax), or the logits
        themselves in a _logits logprobs_mode; the sampler's tokens and the prompt tokens that prompt_logprobs scores
        (which no processor touches, so a processed mode scores them as its raw one does). A rank, as vLLM's: how many
        tokens are at least as likely (1: the most likely)."""
        if self.as_logits:
            raw = raw.float()
            top = raw.topk(k, -1) if k > 0 else None
            targets_logits = raw.gather(1, targets.unsqueeze(1))
            return (top.values if top else None, top.indices if top else None, targets_logits.squeeze(1),
                    (raw >= targets_logits).sum(-1))
        if self._fused_logprobs(k, raw.size(1)):
            from nanovllm.kernels.logprobs import logprob_stats
            lse, top_values, top_ids = logprob_stats(raw, k)
        else:
            raw = raw.float()
            lse = torch.logsumexp(raw, -1)
            top = raw.topk(k, -1) if k > 0 else None
            top_values, top_ids = (top.values, top.indices) if top else (None, None)
        target_logits = raw.gather(1, targets.unsqueeze(1))
        ranks = (raw >= target_logits).sum(-1)
        chosen = target_logits.squeeze(1).float() - lse
        return top_values - lse.unsqueeze(1) if top_values is not None else None, top_ids, chosen, ranks


def _noise(like: torch.Tensor, st: SamplingTensors, generator, token_ids: torch.Tensor | None = None, draws=None):
    """Exp(1) draws shaped like `like` [batch, n]; token_ids [batch, n] gives each candidate's vocabulary id
    (None: candidate i is token i). A seeded row draws one Exp(1) per vocabulary id from its own generator,
    so its tokens do not depend on how many candidates the rest of the batch needs. draws (CUDA): the race kernel's
    draws for (shape, token_ids), each a function of its row's key and stream and the token id."""
    if draws is not None:
        return draws(like.shape, token_ids)
    noise = torch.empty(like.shape, device=like.device).exponential_(1, generator=generator)
    for row, gen in st.generators or ():
        draws = torch.empty(st.vocab_size or like.size(1), device=like.device).exponential_(1, generator=gen)
        noise[row] = draws if token_ids is None else draws[token_ids[row]]
    return noise


def race_in_log_space(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T - log E): the exponential race on softmax(logits / T)."""
    return (logits.float() / temperatures - noise.clamp(min=1e-10).log()).argmax(-1)


def _race(probs: torch.Tensor, st: SamplingTensors, generator, token_ids: torch.Tensor | None = None, draws=None):
    """The exponential race among candidates: argmax(p / E) picks candidate i with probability p_i."""
    noise = _noise(probs, st, generator, token_ids, draws)
    pick = probs.div_(noise.clamp_(min=1e-10)).argmax(-1)
    return pick if token_ids is None else token_ids.gather(1, pick.unsqueeze(1)).squeeze(1)


def _filter(logits: torch.Tensor, temperatures: torch.Tensor,
            st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min-p and top-k, then top-p over what they kept (renormalized), as vLLM orders them: (the candidates'
    probabilities, best first, 0 where removed [batch, c]; their token ids [batch, c]; which were removed [batch, c]),
    for the race among the rest.
    Each step needs a row's probabilities only up to a factor (min-p's threshold is relative to the top probability,
    top-p's mass to what min-p and top-k kept, the race picks argmax(p / E)), so when every row has a top-k, only the
    max_top_k best logits are ranked (topk instead of a full sort: c = max_top_k) and the softmax covers them alone."""
    if st.max_top_k < logits.size(1):
        values, order = logits.topk(st.max_top_k, -1)
        sorted_probs = torch.softmax(values / temperatures, -1)
    else:
        sorted_probs, order = torch.softmax(logits / temperatures, -1).sort(-1, descending=True)
    rank = torch.arange(sorted_probs.size(1), device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if st.top_ks is not None:
        remove |= rank >= st.top_ks.unsqueeze(1)
    if st.min_ps is not None:
        remove |= sorted_probs < st.min_ps.unsqueeze(1) * sorted_probs[:, :1]
    if st.top_ps is not None:
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        kept = sorted_probs.masked_fill(remove, 0.0)
        mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
        remove |= mass_before >= st.top_ps.unsqueeze(1)
    remove[:, 0] = False  # the most likely token always stays
    return sorted_probs.masked_fill(remove, 0.0), order, remove


def processed_logits(logits: torch.Tensor, st: SamplingTensors, kept: tuple | None) -> torch.Tensor:
    """vLLM's processed logits [batch, vocab] float32: the logits after the processors, divided by the temperature
    (a greedy row's by 1, as vLLM does), with -inf for every token top-k, top-p and min-p removed (kept: _filter's
    result for the batch, None when no row filters). Their softmax is what the sampler draws each row's token from,
    so the token drawn always has a finite value."""
    greedy = st.temperatures == 0
    temperatures = st.clamped if st.clamped is not None else st.temperatures.clamp(min=MIN_TEMPERATURE)
    out = logits.float() / torch.where(greedy, 1.0, temperatures).unsqueeze(1)  # (the race's temperatures)
    if kept is not None:
        _, order, remove = kept
        removed = torch.ones_like(out, dtype=torch.bool)  # (past the max_top_k candidates: removed)
        removed.scatter_(1, order, remove)
        removed &= ~greedy.unsqueeze(1)  # (a greedy row's own filters are off)
        out.masked_fill_(removed, float("-inf"))
    return out
