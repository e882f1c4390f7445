import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.engine import cuda_memory
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, get_backend
from nanovllm.layers.compile import use_compiled_ops
from nanovllm.layers.penalties import PenaltyState
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.models import build_model
from nanovllm.utils.context import get_context, reset_context, set_context
from nanovllm.utils.distributed import TPGroup, building_for
from nanovllm.utils.loader import init_dummy_weights, load_weights

if TYPE_CHECKING:
    from nanovllm.engine.workers import Workers

logger = logging.getLogger("nanovllm")


@dataclass
class PendingStep:
    """A decode step launched without waiting for its sampled tokens (async scheduling)."""

    seqs: list[Sequence]
    out_index: list[int]  # where each sequence's sampled token goes in its token_ids
    tokens: torch.Tensor  # [batch] on the device: the next step's input ids are taken from here
    tokens_host: torch.Tensor  # a copy in pinned host memory, valid once `ready` has passed
    logprobs_host: tuple | None = None
    ready: "torch.cuda.Event | None" = None


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """Turns scheduled sequences into tensors, runs the model and samples (rank 0).

    With tensor parallelism every rank has one, built for its shard; rank 0's also holds `workers`,
    the other ranks, and `call` runs a method on all of them (see engine/workers.py)."""

    def __init__(self, config: Config, rank: int = 0, group: TPGroup | None = None, workers: "Workers | None" = None):
        self.config = config
        self.rank = rank
        self.group, self.workers = group, workers
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        self.model = self._load_model()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = get_backend(config.attention_backend, config.device)
        self.backend.check_head_dim(self.attn_layers[0].head_dim)
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.penalties: PenaltyState | None = None  # token history, made when a request first needs it
        if self.is_cuda and not config.enforce_eager:
            use_compiled_ops(self.model, True)  # before the warm-up, which compiles them
            use_compiled_ops(self.sampler, True)
        self.allocate_kv_cache(self._count_kv_blocks())
        self.graphs = self._capture_graphs()

    def _load_model(self) -> nn.Module:
        cfg = self.config
        with _default_dtype(cfg.torch_dtype), self.device, building_for(self.group):
            model = build_model(cfg.hf_config)
            if cfg.load_format == "dummy":
                init_dummy_weights(model, cfg.seed)
            else:
                load_weights(model, cfg.model)
        return model.eval()

    def _count_kv_blocks(self) -> int:
        """On CUDA: what is left after a warm-up at the largest step; on CPU: the configured budget."""
        cfg = self.config
        if self.is_cuda:
            cuda_memory.warmup(self)
            num_blocks = cuda_memory.num_kvcache_blocks(self)
        else:
            budget = int(cfg.cpu_kvcache_gb * 2**30)
            num_blocks = cfg.num_kvcache_blocks if cfg.num_kvcache_blocks > 0 else budget // self.block_bytes
        if self.group is not None:  # every rank must hold the same blocks; the scheduler counts rank 0's
            num_blocks = self.group.min(num_blocks, self.device)
        return num_blocks

    def _capture_graphs(self):
        """Decode CUDA graphs, after a warm-up of every prefill kernel variant (they JIT here, not mid-run)."""
        cfg = self.config
        if not self.is_cuda:
            return None
        cuda_memory.warmup_prefill_variants(self)
        if cfg.enforce_eager:
            return None
        if not self.backend.supports_cuda_graphs:
            if self.rank == 0:
                logger.warning("CUDA graphs are off (attention backend %s): decode runs eagerly", self.backend.name)
            return None
        from nanovllm.engine.cuda_graph import DecodeGraphs
        return DecodeGraphs(self)

    def call(self, method: str, *args):
        """Run `method` on every rank (rank 0 sends it to the workers first); rank 0's result."""
        if self.workers is None:
            return getattr(self, method)(*args)
        return self.workers.call(self, method, *args)

    def release_graphs(self):
        """Destroy the decode graphs. With TP this must come before the NCCL group is torn down: NCCL keeps a
        reference for every graph that captured one of its collectives, and tearing down waits for them."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def exit(self):
        start = time.monotonic()
        self.release_graphs()
        logger.debug("rank 0: graphs released in %.2fs", time.monotonic() - start)
        if self.workers is not None:
            self.workers.shutdown()

    @property
    def block_bytes(self) -> int:
        layer = self.attn_layers[0]
        itemsize = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int):
        cfg = self.config
        if num_blocks * self.block_size < cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0)} blocks x {self.block_size} tokens, fewer than "
                f"max_model_len={cfg.max_model_len}: lower max_model_len, or give the cache more room "
                "(num_kvcache_blocks, cpu_kvcache_gb on CPU, gpu_memory_utilization on GPU)")
        cfg.num_kvcache_blocks = num_blocks
        layer = self.attn_layers[0]
        # One tensor for every layer's K and V: [2, layers, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    layer.head_dim, dtype=cfg.torch_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.block_bytes / 2**30)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.is_cuda)
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        return self._tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            max_seqlen_q, max_seqlen_k = max(max_seqlen_q, end - start), max(max_seqlen_k, end)
            if not seq.block_table:  # warm-up sequences own no cache
                continue
            for i in range(start // self.block_size, (end + self.block_size - 1) // self.block_size):
                base = seq.block_table[i] * self.block_size
                lo, hi = max(start, i * self.block_size), min(end, (i + 1) * self.block_size)
                slot_mapping.extend(range(base + lo - i * self.block_size, base + hi - i * self.block_size))
        has_history = cu_seqlens_k[-1] > cu_seqlens_q[-1]
        set_context(True, cu_seqlens_q=self._tensor(cu_seqlens_q, torch.int32),
                    cu_seqlens_k=self._tensor(cu_seqlens_k, torch.int32),
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    slot_mapping=self._tensor(slot_mapping, torch.int32) if slot_mapping else None,
                    block_tables=self._block_tables(seqs) if has_history else None)
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64)

    def prepare_decode(self, seqs: list[Sequence]):
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1)
        set_context(False, slot_mapping=self._tensor(slot_mapping, torch.int32),
                    context_lens=self._tensor(context_lens, torch.int32), block_tables=self._block_tables(seqs))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        if not is_prefill and self.graphs is not None and self.graphs.can_run(input_ids.size(0)):
            return self.model.compute_logits(self.graphs.replay(input_ids, positions, get_context()))
        return self.model.compute_logits(self.model(input_ids, positions))

    def prepare_sample(self, seqs: list[Sequence], is_prefill: bool) -> SamplingTensors:
        """Per-row sampling tensors; the optional ones only when some row needs them."""
        sps = [seq.sampling_params for seq in seqs]
        # a chunk of a longer prefill samples a token that is thrown away: it must not use up seeded draws
        keeps = [not is_prefill or seq.samples_this_step for seq in seqs]
        vocab = self.config.hf_config.vocab_size
        st = SamplingTensors(self._tensor([sp.temperature for sp in sps], torch.float32),
                             any_greedy=any(sp.greedy for sp in sps), all_greedy=all(sp.greedy for sp in sps),
                             vocab_size=vocab)
        if any(sp.needs_filtering for sp in sps):
            if any(sp.top_k > 0 for sp in sps):
                top_ks = [min(sp.top_k, vocab) if sp.top_k > 0 and not sp.greedy else vocab for sp in sps]
                st.top_ks, st.max_top_k = self._tensor(top_ks, torch.int64), max(top_ks)
            if any(sp.top_p < 1 for sp in sps):
                st.top_ps = self._tensor([sp.top_p for sp in sps], torch.float32)
            if any(sp.min_p > 0 for sp in sps):
                st.min_ps = self._tensor([sp.min_p for sp in sps], torch.float32)
        if any(sp.needs_penalties for sp in sps):
            if self.penalties is None:
                self.penalties = PenaltyState(vocab, self.device)
            st.penalty_rows, st.seen_mask, st.output_counts = self.penalties.gather(seqs)
            st.sampled_rows = self._tensor(keeps, torch.bool)
        if any(sp.repetition_penalty != 1 for sp in sps):
            st.repetition = self._tensor([sp.repetition_penalty for sp in sps], torch.float32)
        if any(sp.presence_penalty or sp.frequency_penalty for sp in sps):
            st.presence = self._tensor([sp.presence_penalty for sp in sps], torch.float32)
            st.frequency = self._tensor([sp.frequency_penalty for sp in sps], torch.float32)
        banned_rows, banned_ids = [], []
        for i, (seq, sp) in enumerate(zip(seqs, sps)):
            if seq.num_completion_tokens < sp.min_tokens:  # EOS and stop tokens may not come yet
                ids = sp.stop_token_ids + ([] if sp.ignore_eos else self.config.eos_token_ids)
                banned_rows += [i] * len(ids)
                banned_ids += ids
        if banned_rows:
            st.banned = (self._tensor(banned_rows, torch.int64), self._tensor(banned_ids, torch.int64))
        for i, (seq, sp, keep) in enumerate(zip(seqs, sps, keeps)):
            if sp.seed is not None and not sp.greedy and keep:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=self.device).manual_seed(sp.seed)
                st.generators = (st.generators or []) + [(i, seq.generator)]
        st.num_logprobs = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=-1)
        return st

    def _logprob_dicts(self, seqs: list[Sequence], tokens: list[int], logprobs) -> list[dict[int, float] | None]:
        top_values, top_ids, chosen = logprobs
        top_values = top_values.tolist() if top_values is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        chosen = chosen.tolist()
        out = []
        for i, seq in enumerate(seqs):
            k = seq.sampling_params.logprobs
            if k is None:
                out.append(None)
                continue
            d = dict(zip(top_ids[i][:k], top_values[i][:k])) if k else {}
            d.setdefault(tokens[i], chosen[i])
            out.append(d)
        return out

    def _sample(self, logits: torch.Tensor, sampling: SamplingTensors):
        """Sample (rank 0) and record the new tokens in the penalties' history, all on the device."""
        tokens, logprobs = self.sampler(logits, sampling, self.generator)
        if sampling.penalty_rows is not None:
            self.penalties.update(sampling.penalty_rows, tokens, sampling.sampled_rows)
        return tokens, logprobs

    def launch_decode(self, seqs: list[Sequence], previous: "PendingStep | None") -> "PendingStep":
        """Async scheduling (rank 0, one rank): start a decode step and return without waiting for its tokens.
        A sequence whose input is the token `previous` sampled takes it straight from the device."""
        try:
            input_ids, positions = self.prepare_decode(seqs)
            if previous is not None:
                source = {seq.seq_id: (row, index) for row, (seq, index)
                          in enumerate(zip(previous.seqs, previous.out_index))}
                rows = []
                for seq in seqs:
                    row, index = source.get(seq.seq_id, (-1, -1))
                    rows.append(row if index == len(seq) - 1 else -1)  # is its input that step's output?
                if any(row >= 0 for row in rows):
                    rows = self._tensor(rows, torch.int64)
                    input_ids = torch.where(rows >= 0, previous.tokens[rows.clamp(min=0)], input_ids)
            sampling = self.prepare_sample(seqs, False)
            tokens, logprobs = self._sample(self.run_model(input_ids, positions, False), sampling)
            step = PendingStep(seqs, [len(seq) for seq in seqs], tokens, self._to_host(tokens),
                               tuple(self._to_host(t) if t is not None else None for t in logprobs)
                               if logprobs is not None else None)
            if self.is_cuda:
                step.ready = torch.cuda.Event()
                step.ready.record()
            return step
        finally:
            reset_context()

    def settle(self, step: "PendingStep") -> tuple[list[int], list | None]:
        """Wait for a launched step's tokens (only for that step, not for what was launched after it)."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.tokens_host.tolist()
        logprobs = self._logprob_dicts(step.seqs, tokens, step.logprobs_host) if step.logprobs_host else None
        return tokens, logprobs

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[int], list | None] | None:
        """One step; rank 0 returns (sampled token ids, per-sequence logprob dicts or None)."""
        try:
            input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
            sampling = self.prepare_sample(seqs, is_prefill) if self.rank == 0 else None
            logits = self.run_model(input_ids, positions, is_prefill)
            if self.rank != 0:
                return None
            tokens, logprobs = self._sample(logits, sampling)
            tokens = tokens.tolist()
            return tokens, (self._logprob_dicts(seqs, tokens, logprobs) if logprobs is not None else None)
        finally:
            reset_context()
