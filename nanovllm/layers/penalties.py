"""Token history for repetition/presence/frequency penalties, kept on the device between steps.

Each penalized sequence owns a row of two [rows, vocab] buffers (tokens seen in prompt or output; counts of
output tokens). A row is filled once from the sequence's tokens, then updated with one scatter per step
for the whole batch, so no step rebuilds the history from Python lists."""
import torch

from nanovllm.engine.sequence import Sequence


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.rows: dict[int, tuple[int, Sequence]] = {}  # seq_id -> (row, sequence)
        self.free_rows: list[int] = []

    def _grow(self):
        n = max(16, self.seen.size(0))
        self.free_rows += range(self.seen.size(0), self.seen.size(0) + n)
        self.seen = torch.cat([self.seen, torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)])
        self.counts = torch.cat([self.counts, torch.zeros(n, self.vocab_size, device=self.device)])

    def _row(self, seq: Sequence) -> int:
        if seq.seq_id in self.rows:
            return self.rows[seq.seq_id][0]
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.rows[seq.seq_id] = (row, seq)
        self.seen[row].zero_()
        self.counts[row].zero_()
        known = [t for t in seq.token_ids if t >= 0]  # not async scheduling's placeholders
        self.seen[row, torch.tensor(known, dtype=torch.long, device=self.device)] = True
        completion = torch.tensor([t for t in seq.completion_token_ids if t >= 0], dtype=torch.long,
                                  device=self.device)
        self.counts[row].index_add_(0, completion, torch.ones(completion.numel(), device=self.device))
        return row

    def gather(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row ids [batch], seen mask [batch, vocab], output counts [batch, vocab]) for this step."""
        for seq_id, (row, seq) in list(self.rows.items()):  # rows of finished sequences come back
            if seq.is_finished:
                del self.rows[seq_id]
                self.free_rows.append(row)
        rows = torch.tensor([self._row(seq) for seq in seqs], device=self.device)
        return rows, self.seen[rows], self.counts[rows]

    def update(self, rows: torch.Tensor, tokens: torch.Tensor, sampled: torch.Tensor):
        """Record the tokens of the rows that really sampled (not a chunk of a longer prefill)."""
        rows, tokens = rows[sampled], tokens[sampled]
        self.seen[rows, tokens] = True
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True)
