from collections import deque

from nanovllm.config import Config
from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Prefill first (chunked when a prompt exceeds the step's token budget), then decode.

    When decode runs out of KV blocks, the most recently admitted sequence is preempted: its
    blocks are freed and it is recomputed later (its blocks may come back from the prefix cache).
    """

    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(config.eos_token_ids)
        # vLLM's primary EOS (the tokenizer's): it ends with stop_reason None; the others (generation_config's)
        # vLLM turns into stop_token_ids, which report their id
        self.primary_eos = config.primary_eos_token_id
        self.block_manager = BlockManager(num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.lora = None  # a LoRAManager with enable_lora (the engine sets it)

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

    def _can_admit(self, seq: Sequence) -> bool:
        # admitted sequences (and the samples forked from them) join running, which max_num_seqs bounds
        return len(self.running) + len(seq.forks) < self.max_num_seqs and self.block_manager.can_allocate(seq)

    def can_prefill(self) -> bool:
        """Whether the next schedule() would be a prefill (the head of waiting is mid-prefill or fits)."""
        return bool(self.waiting) and (bool(self.waiting[0].block_table) or self._can_admit(self.waiting[0]))

    def schedule(self) -> ScheduledBatch:
        scheduled: list[Sequence] = []
        forks: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        loads: list[tuple[int, object]] = []
        if self.lora is not None and self.lora.stale:
            self._reload_lora_slots(loads)
        budget = self.max_num_batched_tokens
        skipped: list[Sequence] = []  # requests whose adapter has no free slot: those behind them go first (vLLM's)
        # Prefill: admit waiting sequences; the one at the head may be mid-way through a chunked prefill.
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self._can_admit(seq):
                    break
                if seq.lora_id and not self._take_lora_slot(seq, scheduled, loads):
                    skipped.append(self.waiting.popleft())
                    continue
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
            # Its prompt completes this step: its other samples share the prompt's K/V and sample their first
            # tokens from the same logits (n > 1).
            for child in seq.forks:
                copy = self.block_manager.fork(seq, child)
                if copy is not None:
                    copies.append(copy)
                child.num_prefix_hit_tokens = seq.num_prefix_hit_tokens
                child.prompt_logprobs = seq.prompt_logprobs  # one prompt, scored once (filled after this step)
                child.status = SequenceStatus.RUNNING
                child.lora_slot = seq.lora_slot
                self.running.append(child)
                forks.append((child, len(scheduled) - 1))
            seq.forks = []
        # the skipped keep their places at the front (after a prompt this step left half prefilled, which must stay
        # first: its slot is counted as in use only while it is)
        at = 1 if self.waiting and self.waiting[0].block_table else 0
        for seq in reversed(skipped):
            self.waiting.insert(at, seq)
        if scheduled:
            out_index = [seq.num_tokens if seq.samples_this_step else -1 for seq in scheduled]
            out_index += [child.num_tokens for child, _ in forks]
            # the logits of positions start..min(end, prompt length - 1) score the prompt tokens after them
            scored = [(i, min(seq.num_cached_tokens + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
                       - seq.num_cached_tokens) for i, seq in enumerate(scheduled) if seq.needs_prompt_logprobs]
            return ScheduledBatch(scheduled, True, out_index, forks, copies, scored, loads)

        # Decode: one token per running sequence.
        done_when_settled = []  # async scheduling: their token in flight already ends them (length)
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            if seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                done_when_settled.append(seq)
                continue
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
        self.running.extendleft(reversed(scheduled + done_when_settled))
        return ScheduledBatch(scheduled, False, [seq.num_tokens for seq in scheduled], lora_loads=loads)

    def _take_lora_slot(self, seq: Sequence, scheduled: list[Sequence], loads: list) -> bool:
        """A device slot for the adapter of `seq` (its load added to `loads`), or False when all hold adapters in
        use, by running sequences or this step's (a prefill in progress is the first of those)."""
        in_use = {s.lora_slot for s in (*self.running, *scheduled) if s.lora_id}
        got = self.lora.acquire(seq.lora_id, in_use)
        if got is None:
            return False
        seq.lora_slot, load = got
        if load is not None:
            loads.append((seq.lora_slot, load))
        return True

    def _reload_lora_slots(self, loads: list):
        """After a failed step (LoRAManager.forget): a slot for the adapter of each sequence that holds one, loaded
        again: the running sequences and a chunked prefill in progress at the head of waiting (it keeps its blocks
        and slot, and is not admitted again). They were given slots together, so they use at most max_loras
        adapters and each finds one."""
        self.lora.stale = False
        slots: dict[int, int] = {}
        mid_prefill = [self.waiting[0]] if self.waiting and self.waiting[0].block_table else []
        for seq in (*self.running, *mid_prefill):
            if seq.lora_id:
                if seq.lora_id not in slots:
                    slot, load = self.lora.acquire(seq.lora_id, set(slots.values()))
                    slots[seq.lora_id] = slot
                    if load is not None:
                        loads.append((slot, load))
                seq.lora_slot = slots[seq.lora_id]

    def undo_prefill(self, batch: ScheduledBatch):
        """A prefill step that failed before its tokens came back (an error or KeyboardInterrupt in the executor)
        computed nothing the books can count on. The prompts it completed were moved to running as if prefilled:
        decoding them would attend over K/V never written. They go back to waiting with their blocks freed (computed
        again, as a preempted sequence is), and the samples they forked rejoin them, to be forked at the retried
        prefill. A prompt it left half prefilled stays at the head of waiting, its earlier chunks' K/V counted."""
        for child, row in reversed(batch.forks):
            self.running.remove(child)
            self.block_manager.deallocate(child)
            child.status, child.lora_slot, child.prompt_logprobs = SequenceStatus.WAITING, -1, child.new_logprobs()
            batch.seqs[row].forks.insert(0, child)
        back = [seq for seq in batch.seqs if seq.status == SequenceStatus.RUNNING]
        for seq in back:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.WAITING
            if seq.needs_prompt_logprobs:  # its earlier chunks' scores: the prompt is scored again from its start
                seq.prompt_logprobs = seq.new_logprobs()
        at = 1 if self.waiting and self.waiting[0].block_table else 0  # (behind a prompt still mid-prefill)
        for seq in reversed(back):
            self.waiting.insert(at, seq)

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        # Stay behind a chunked prefill in progress: it holds blocks and must finish first.
        mid_prefill = bool(self.waiting and self.waiting[0].block_table)
        self.waiting.insert(1 if mid_prefill else 0, seq)

    def preempt_all(self):
        """Free every sequence's KV blocks (reset_prefix_cache(reset_running_requests=True)): the running go back
        to the head of waiting in their order, and a prompt mid-prefill starts again (its chunks' prompt logprobs
        with it); each is computed again when it is next scheduled."""
        if self.waiting and self.waiting[0].block_table:
            seq = self.waiting[0]
            self.block_manager.deallocate(seq)
            if seq.needs_prompt_logprobs:
                seq.prompt_logprobs = seq.new_logprobs()
        for seq in reversed(self.running):
            self.preempt(seq)
        self.running.clear()

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list | None = None,
                    prompt_logprobs: list | None = None) -> list[Sequence]:
        """After a step: count the K/V it computed, put each sampled token at its out_index, and finish sequences on
        EOS, stop token ids or length. Returns the sequences that received a token.

        The plain loop calls this right after the step: the token is appended. Under async scheduling the step was
        launched a step earlier: the token replaces the placeholder the engine appended at launch, and meanwhile
        the sequence may have finished (this token is then spare work) or been preempted (no K/V left to count)."""
        for (i, _), scored in zip(batch.prompt_logprobs, prompt_logprobs or ()):
            seq = batch.seqs[i]
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context to score it
            seq.prompt_logprobs.extend(scored)
        updated = []
        for i, (seq, index, token_id) in enumerate(zip(batch.rows, batch.out_index, token_ids)):
            if seq.is_finished:
                continue
            if seq.block_table:
                seq.num_cached_tokens = index if index >= 0 else seq.num_cached_tokens + seq.num_scheduled_tokens
                self.block_manager.hash_blocks(seq)
            if index < 0:
                continue  # a chunk of a longer prefill: its sampled token is meaningless
            seq.set_token(index, token_id)
            if logprobs is not None and logprobs[i] is not None:
                seq.logprobs.append(logprobs[i])
            seq.new_token = token_id
            updated.append(seq)
            self._check_stop(seq, token_id, index + 1)
        return updated

    def _check_stop(self, seq: Sequence, token_id: int, length: int) -> bool:
        """Finish `seq` if the token at position length-1 ends it (EOS, a stop id, max_tokens, max_model_len)."""
        sp = seq.sampling_params
        num_completion = length - seq.num_prompt_tokens
        eos = not seq.ignore_eos and token_id in self.eos_token_ids
        if num_completion >= sp.min_tokens and (eos or token_id in sp.stop_token_ids):
            self.finish(seq, "stop")
            if not (eos and token_id == self.primary_eos):  # (vLLM checks its EOS first: stop_reason None)
                seq.stop_reason = token_id
        elif num_completion >= seq.max_tokens or length >= self.max_model_len:
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str):
        seq.drop_pending()
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        for queue in (self.running, self.waiting):  # a preempted sequence can finish from the waiting queue
            if seq in queue:
                queue.remove(seq)
                break
