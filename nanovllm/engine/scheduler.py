from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Prefill first (chunked when a prompt exceeds the step's token budget), then decode.

    When decode runs out of KV blocks, the most recently admitted sequence is preempted: its
    blocks are freed and it is recomputed later (its blocks may come back from the prefix cache).
    """

    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(config.eos_token_ids)
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def abort(self, seq: Sequence):
        """Remove a sequence from the queues and free its blocks (used when a step fails)."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # Prefill: admit waiting sequences; the one at the head may be mid-way through a chunked prefill.
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                if len(self.running) >= self.max_num_seqs:  # admitted sequences join running
                    break
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if seq.num_prefix_hit_tokens < 0:
                    seq.num_prefix_hit_tokens = seq.num_cached_tokens
            remaining = seq.num_tokens - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                break  # the rest of this prompt goes in the next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if scheduled:
            return scheduled, True

        # Decode: one token per running sequence.
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        # Stay behind a chunked prefill in progress: it holds blocks and must finish first.
        mid_prefill = bool(self.waiting and self.waiting[0].block_table)
        self.waiting.insert(1 if mid_prefill else 0, seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list | None = None) -> list[Sequence]:
        """Record computed K/V and sampled tokens; finish sequences on EOS, stop token ids or length.
        Returns the sequences that received a new token this step."""
        updated = []
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            self.block_manager.hash_blocks(seq)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # a chunk of a longer prefill: its sampled token is meaningless
            seq.append_token(token_id)
            if logprobs is not None and logprobs[i] is not None:
                seq.logprobs.append(logprobs[i])
            updated.append(seq)
            sp = seq.sampling_params
            may_stop = seq.num_completion_tokens >= sp.min_tokens
            if may_stop and ((not seq.ignore_eos and token_id in self.eos_token_ids) or token_id in sp.stop_token_ids):
                self.finish(seq, "stop")
            elif seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
        return updated

    def finish(self, seq: Sequence, reason: str):
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
