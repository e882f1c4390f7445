"""Logits processors: per-step changes to the logits before sampling, each prepared once per step for the rows
that need it and skipped entirely when none does. The grammar bitmask (structured outputs), allowed_token_ids,
bad_words, min_tokens, logit_bias and the penalties are processors.

A processor's `prepare` reads the step's sequences (duck-typed: `seq_id`, `sampling_params`, `token_ids`,
`num_prompt_tokens`, `num_completion_tokens`, `is_finished`, `grammar`) and returns this step's state, or None."""
from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch

from nanovllm.layers.context import ToDevice


class LogitsProcessor:
    # A constraint removes tokens a request may not produce at all: it is applied before logprobs are taken, so they
    # see the constrained distribution (as in vLLM). The others change preferences and come after.
    is_constraint = False

    def prepare(self, seqs: Rows, sampled: list[bool], to_device: ToDevice) -> object | None:
        """This step's state; None when no row needs the processor. sampled[i]: row i's token is kept
        (False for a chunk of a longer prefill)."""
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, state) -> torch.Tensor:
        """logits [batch, vocab] float32 -> processed logits. A constraint may change `logits` in place; the others
        return a new tensor (the sampler keeps the constrained logits for the logprobs)."""
        raise NotImplementedError

    def update(self, state, tokens: torch.Tensor):
        """After sampling: tokens [batch] int64 on the device (for processors that keep a history)."""

    def undo(self, state):
        """Forget what `update` recorded with `state` (nothing if it did not run): the step's tokens were dropped,
        and it is sampled again. Safe to call twice."""


class MinTokensProcessor(LogitsProcessor):
    """Until a row has min_tokens completion tokens, EOS and its stop_token_ids may not be sampled; EOS with
    ignore_eos too, as vLLM bans its all_stop_token_ids (min_tokens=max_tokens, ignore_eos=True: no EOS at all)."""

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def prepare(self, seqs, sampled, to_device):
        rows, ids = [], []
        for i, seq in enumerate(seqs):
            sp = seq.sampling_params
            if seq.num_completion_tokens < sp.min_tokens:
                banned = sp.stop_token_ids + self.eos_token_ids
                rows += [i] * len(banned)
                ids += banned
        return (to_device(rows, torch.int64), to_device(ids, torch.int64)) if rows else None

    def apply(self, logits, state):
        return logits.index_put(state, torch.tensor(float("-inf"), device=logits.device))


class AllowedTokensProcessor(LogitsProcessor):
    """allowed_token_ids: every other token of the row gets -inf."""

    def prepare(self, seqs, sampled, to_device):
        rows, ids = [], []
        for i, seq in enumerate(seqs):
            allowed = seq.sampling_params.allowed_token_ids
            if allowed:
                rows += [i] * len(allowed)
                ids += allowed
        if not rows:
            return None
        return to_device(sorted(set(rows)), torch.int64), to_device(rows, torch.int64), to_device(ids, torch.int64)

    def apply(self, logits, state):
        masked, rows, ids = state
        out = logits.index_fill(0, masked, float("-inf"))
        return out.index_put((rows, ids), logits[rows, ids])


class BadWordsProcessor(LogitsProcessor):
    """bad_words, each as token sequences (Sequence.bad_words_ids): the last token of a sequence is banned where the
    tokens before it end the row's output so far (a one-token word: always), as vLLM matches them: a prompt ending
    in a word's first tokens bans nothing. Read when the step samples, from the settled
    tokens: under async scheduling the engine settles the step before first (as for a grammar)."""

    def prepare(self, seqs, sampled, to_device):
        rows = [(i, seq) for i, seq in enumerate(seqs) if getattr(seq, "bad_words_ids", None)]
        return (rows, to_device) if rows else None

    def apply(self, logits, state):
        rows, to_device = state
        banned_rows, banned_ids = [], []
        for i, seq in rows:
            history, outputs = seq.token_ids, len(seq.token_ids) - seq.num_prompt_tokens
            for word in seq.bad_words_ids:
                before = len(word) - 1
                if before == 0 or (before <= outputs and history[len(history) - before:] == word[:-1]):
                    banned_rows.append(i)
                    banned_ids.append(word[-1])
        if not banned_rows:
            return logits
        index = (to_device(banned_rows, torch.int64), to_device(banned_ids, torch.int64))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


class LogitBiasProcessor(LogitsProcessor):
    """logit_bias: {token id: bias} added to the row's logits."""

    def prepare(self, seqs, sampled, to_device):
        rows, ids, values = [], [], []
        for i, seq in enumerate(seqs):
            for token, bias in (seq.sampling_params.logit_bias or {}).items():
                rows.append(i)
                ids.append(token)
                values.append(bias)
        if not rows:
            return None
        return to_device(rows, torch.int64), to_device(ids, torch.int64), to_device(values, torch.float32)

    def apply(self, logits, state):
        rows, ids, values = state
        return logits.index_put((rows, ids), values, accumulate=True)


class PenaltiesProcessor(LogitsProcessor):
    """Repetition (HF/CTRL, on prompt and output tokens), presence and frequency (OpenAI, on output tokens).

    The token history stays on the device between steps: each penalized sequence owns a line of two
    [lines, vocab] buffers (tokens seen in prompt or output; counts of output tokens), filled once from the
    sequence's tokens and then updated with one scatter per step for the whole batch. Nothing here waits for the
    device (no boolean indexing, no blocking copies), so under async scheduling the host prepares the next step
    while this one runs. On CUDA the penalties are one Triton pass (kernels/penalties.py)."""

    def __init__(self, vocab_size: int, device: torch.device, fused: bool = False):
        self.vocab_size, self.device = vocab_size, device
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.lines: dict[int, tuple[int, object]] = {}  # seq_id -> (line, sequence)
        self.free_lines: list[int] = []
        self.fused = fused  # one Triton pass (kernels/penalties.py); the torch ops below are its reference

    def _grow(self):
        n = max(16, self.seen.size(0))
        self.free_lines += range(self.seen.size(0), self.seen.size(0) + n)
        self.seen = torch.cat([self.seen, torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)])
        self.counts = torch.cat([self.counts, torch.zeros(n, self.vocab_size, device=self.device)])

    def _line(self, seq, to_device: ToDevice) -> int:
        if seq.seq_id in self.lines:
            return self.lines[seq.seq_id][0]
        if not self.free_lines:
            self._grow()
        line = self.free_lines.pop()
        self.lines[seq.seq_id] = (line, seq)
        self.seen[line].zero_()
        self.counts[line].zero_()
        known = [t for t in seq.token_ids if t >= 0]  # not async scheduling's placeholders
        if known:
            self.seen[line, to_device(known, torch.int64)] = True
        completion = [t for t in seq.token_ids[seq.num_prompt_tokens:] if t >= 0]
        if completion:
            self.counts[line].index_add_(0, to_device(completion, torch.int64),
                                         torch.ones(len(completion), device=self.device))
        return line

    def prepare(self, seqs, sampled, to_device):
        sps = [seq.sampling_params for seq in seqs]
        if not any(sp.needs_penalties for sp in sps):
            return None
        for seq_id, (line, seq) in list(self.lines.items()):  # lines of finished sequences come back
            if seq.is_finished:
                del self.lines[seq_id]
                self.free_lines.append(line)
        state = {"lines": to_device([self._line(seq, to_device) for seq in seqs], torch.int64),
                 "sampled": to_device(sampled, torch.bool)}
        if any(sp.repetition_penalty != 1 for sp in sps):
            state["repetition"] = to_device([sp.repetition_penalty for sp in sps], torch.float32)
        if any(sp.presence_penalty or sp.frequency_penalty for sp in sps):
            state["presence"] = to_device([sp.presence_penalty for sp in sps], torch.float32)
            state["frequency"] = to_device([sp.frequency_penalty for sp in sps], torch.float32)
        return state

    def apply(self, logits, state):
        if self.fused:
            from nanovllm.kernels.penalties import apply_penalties
            return apply_penalties(logits, state["lines"], self.seen, self.counts, state.get("repetition"),
                                   state.get("presence"), state.get("frequency"))
        return self.apply_torch(logits, state)

    def apply_torch(self, logits, state):
        lines = state["lines"]
        if "repetition" in state:  # shrink positive logits, grow negative ones, of every token seen so far
            penalty = torch.where(self.seen[lines], state["repetition"].unsqueeze(1), 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if "presence" in state:
            counts = self.counts[lines]
            logits = logits - state["presence"].unsqueeze(1) * (counts > 0) - state["frequency"].unsqueeze(1) * counts
        return logits

    def update(self, state, tokens):
        """Record the tokens of the rows that really sampled (not a chunk of a longer prefill). Each sequence has
        one row, so no (line, token) pair repeats; a row that did not sample adds nothing."""
        lines, sampled = state["lines"], state["sampled"]
        before = self.seen[lines, tokens]
        state["seen_before"] = tokens, before  # (for undo: set before anything is written)
        self.seen[lines, tokens] = before | sampled
        self.counts.index_put_((lines, tokens), sampled.to(self.counts.dtype), accumulate=True)
        state["counted"] = True

    def undo(self, state):
        if "seen_before" not in state:
            return
        lines, sampled = state["lines"], state["sampled"]
        tokens, before = state.pop("seen_before")
        self.seen[lines, tokens] = before
        if state.pop("counted", False):
            self.counts.index_put_((lines, tokens), -sampled.to(self.counts.dtype), accumulate=True)


@dataclass
class GrammarState:
    rows: list[int]  # rows of the batch whose sequence has a grammar
    seqs: list  # their sequences
    to_device: ToDevice


class GrammarProcessor(LogitsProcessor):
    """Structured outputs: each constrained row's matcher (`seq.grammar.matcher`, an xgrammar GrammarMatcher advanced
    by the engine as tokens settle) fills its row of a token bitmask, and the tokens its grammar does not allow next
    get -inf, as do the model's ids past the tokenizer's. The bitmask is filled in `apply`, when the forward pass is
    already queued, so on a GPU the host fills it while the device computes; the rows are filled on several threads,
    in pinned memory, and copied without blocking. Unconstrained rows are neither filled nor copied nor masked."""

    is_constraint = True

    def __init__(self, threads: int = 1):
        self.threads = threads  # that fill the bitmask (structured_outputs.grammar_threads)

    def prepare(self, seqs, sampled, to_device):
        rows = [i for i, (seq, keep) in enumerate(zip(seqs, sampled))
                if keep and getattr(seq, "grammar", None) is not None]
        return GrammarState(rows, [seqs[i] for i in rows], to_device) if rows else None

    def apply(self, logits, state):
        from nanovllm.sampling.structured_outputs import fill_bitmasks, require_xgrammar
        xgr = require_xgrammar()
        # A sequence that ended after this step was prepared (async scheduling settles the step before while this
        # one runs) samples a token nobody reads: its row allows every token (its matcher has no mask to give).
        matchers = [None if seq.is_finished else seq.grammar.matcher for seq in state.seqs]
        vocab = state.seqs[0].grammar.vocab_size  # the tokenizer's, the same for every sequence of an engine
        host = torch.empty((len(matchers), (vocab + 31) // 32), dtype=torch.int32, pin_memory=logits.is_cuda)
        if not fill_bitmasks(matchers, host, self.threads, state.seqs[0].grammar.stop_token):
            return logits
        bitmask = host.to(logits.device, non_blocking=True)
        indices = None
        if len(state.rows) < logits.size(0):  # xgrammar indexes the bitmask and the logits with the same row ids
            indices = state.to_device(state.rows, torch.int32)
            full = torch.empty((logits.size(0), bitmask.size(1)), dtype=torch.int32, device=logits.device)
            full[indices.long()] = bitmask
            bitmask = full
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
        if vocab < logits.size(1):  # the model's ids past the tokenizer's, in place (a view)
            with torch.inference_mode():  # float32 logits can be the model's own output, an inference tensor
                padding = logits[:, vocab:]
                if indices is None:
                    padding.fill_(float("-inf"))
                else:
                    padding.index_fill_(0, indices.long(), float("-inf"))
        return logits
