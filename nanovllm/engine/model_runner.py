import logging
from contextlib import contextmanager

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.engine import kv_cache
from nanovllm.engine.batch import ForwardBatch, PendingStep, ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.warmup import warmup_prefill_variants
from nanovllm.layers.attention import Attention, get_backend
from nanovllm.layers.compile import use_compiled_ops
from nanovllm.layers.sampler import Sampler
from nanovllm.models import build_model
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.distributed import TPGroup, building_for
from nanovllm.utils.loader import init_dummy_weights, load_weights

logger = logging.getLogger("nanovllm")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """One rank's model, KV cache and decode graphs: turns a ScheduledBatch into a ForwardBatch, runs the model
    and (rank 0) samples. It knows nothing of other ranks; an executor drives one runner per rank."""

    def __init__(self, config: Config, rank: int = 0, group: TPGroup | None = None):
        self.config = config
        self.rank = rank
        self.group = group
        self.block_size = config.kvcache_block_size
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
        self.sampler = Sampler(config.hf_config.vocab_size, config.eos_token_ids, self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        if self.is_cuda and not config.enforce_eager:
            use_compiled_ops(self.model, True)  # before the warm-up, which compiles them
            use_compiled_ops(self.sampler, True)
        self.num_kvcache_blocks = kv_cache.count_blocks(self)
        self.kv_cache = kv_cache.allocate(self, self.num_kvcache_blocks)
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

    def _capture_graphs(self):
        """Decode CUDA graphs, after a warm-up of every prefill kernel variant (they JIT here, not mid-run)."""
        if not self.is_cuda:
            return None
        warmup_prefill_variants(self)
        if self.config.enforce_eager:
            return None
        if not self.backend.supports_cuda_graphs:
            if self.rank == 0:
                logger.warning("CUDA graphs are off (attention backend %s): decode runs eagerly", self.backend.name)
            return None
        from nanovllm.engine.cuda_graph import DecodeGraphs
        return DecodeGraphs(self)

    def release_graphs(self):
        """Destroy the decode graphs. With TP this must come before the NCCL group is torn down: NCCL keeps a
        reference for every graph that captured one of its collectives, and tearing down waits for them."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def describe(self) -> dict:
        """What this rank holds (for collective_rpc: every rank answers for itself)."""
        return {"rank": self.rank, "device": str(self.device), "num_kvcache_blocks": self.num_kvcache_blocks,
                "num_parameters": sum(p.numel() for p in self.model.parameters()),
                "cuda_graphs": self.graphs is not None}

    # ---- one step -------------------------------------------------------------------------------
    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.is_cuda)
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def _padded_tables(seqs: list[Sequence]) -> list[list[int]]:
        width = max(len(seq.block_table) for seq in seqs)
        return [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]

    def _prepare_prefill(self, seqs: list[Sequence]) -> ForwardBatch:
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            if not seq.block_table:  # warm-up sequences own no cache
                continue
            for i in range(start // self.block_size, (end + self.block_size - 1) // self.block_size):
                base = seq.block_table[i] * self.block_size
                lo, hi = max(start, i * self.block_size), min(end, (i + 1) * self.block_size)
                slot_mapping.extend(range(base + lo - i * self.block_size, base + hi - i * self.block_size))
        has_history = cu_seqlens_k[-1] > cu_seqlens_q[-1]
        context = self.backend.prefill_context(self._to_device, cu_seqlens_q, cu_seqlens_k, slot_mapping,
                                               self._padded_tables(seqs) if has_history else None)
        # each sequence's last new token: the only position whose logits are sampled
        context.logits_indices = self._to_device([n - 1 for n in cu_seqlens_q[1:]], torch.int64)
        return ForwardBatch(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                            context, None)

    def _prepare_decode(self, seqs: list[Sequence]) -> ForwardBatch:
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1)
        context = self.backend.decode_context(self._to_device, slot_mapping, context_lens, self._padded_tables(seqs))
        return ForwardBatch(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                            context, None)

    def prepare(self, batch: ScheduledBatch, previous: PendingStep | None = None) -> ForwardBatch:
        """This step's tensors. Under async scheduling, a sequence whose input is the token `previous` sampled (still
        a placeholder on the host) takes it straight from the device."""
        seqs = batch.seqs
        fb = self._prepare_prefill(seqs) if batch.is_prefill else self._prepare_decode(seqs)
        if previous is not None:
            source = {seq.seq_id: (row, index) for row, (seq, index)
                      in enumerate(zip(previous.batch.seqs, previous.batch.out_index))}
            rows = []
            for seq in seqs:
                row, index = source.get(seq.seq_id, (-1, -1))
                rows.append(row if index == len(seq) - 1 else -1)  # is its input that step's output?
            if any(row >= 0 for row in rows):
                rows = self._to_device(rows, torch.int64)
                fb.input_ids = torch.where(rows >= 0, previous.tokens[rows.clamp(min=0)], fb.input_ids)
        if self.rank == 0:
            fb.sampling = self.sampler.prepare(seqs, batch.sampled, self._to_device)
        return fb

    @torch.inference_mode()
    def run_model(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [rows of logits_indices, vocab] on rank 0 (None on the other ranks)."""
        set_context(fb.context)
        if not fb.context.is_prefill and self.graphs is not None and self.graphs.can_run(fb.input_ids.size(0)):
            hidden = self.graphs.replay(fb.input_ids, fb.positions, fb.context)
        else:
            hidden = self.model(fb.input_ids, fb.positions)
        return self.model.compute_logits(hidden)

    def launch(self, batch: ScheduledBatch, previous: PendingStep | None = None) -> PendingStep | None:
        """Start a step on the device and return without waiting for its tokens (rank 0; None on other ranks).
        Sampling and the logits processors' bookkeeping stay on the device."""
        try:
            fb = self.prepare(batch, previous)
            logits = self.run_model(fb)
            if self.rank != 0:
                return None
            tokens, logprobs = self.sampler(logits, fb.sampling, self.generator)
            step = PendingStep(batch, tokens, self._to_host(tokens),
                               tuple(self._to_host(t) if t is not None else None for t in logprobs)
                               if logprobs is not None else None)
            if self.is_cuda:
                step.ready = torch.cuda.Event()
                step.ready.record()
            return step
        finally:
            reset_context()

    def settle(self, step: PendingStep) -> tuple[list[int], list | None]:
        """Wait for a launched step's tokens (only for that step, not for what was launched after it):
        (sampled token ids, per-sequence logprob dicts or None)."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.tokens_host.tolist()
        logprobs = self._logprob_dicts(step.batch.seqs, tokens, step.logprobs_host) if step.logprobs_host else None
        return tokens, logprobs

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list | None] | None:
        """One step, waited for; rank 0 returns what `settle` returns, other ranks None."""
        step = self.launch(batch)
        return self.settle(step) if step is not None else None

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    @staticmethod
    def _logprob_dicts(seqs: list[Sequence], tokens: list[int], logprobs) -> list[dict[int, float] | None]:
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
