import logging
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from nanovllm.checkpoint.loader import init_dummy_weights, load_named_weights, load_weights
from nanovllm.config import Config
from nanovllm.distributed.group import TPGroup, building_for
from nanovllm.engine import kv_cache, warmup
from nanovllm.engine.batch import ForwardBatch, LaunchedStep, PendingStep, ScheduledBatch, StepOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.layers import cpu_weights
from nanovllm.layers.attention import Attention, get_backend
from nanovllm.layers.attention.fp8 import is_fp8
from nanovllm.layers.context import get_context, reset_context, set_context, to_device_packed
from nanovllm.layers.linear import deferred_weights
from nanovllm.lora.stack import step_slots
from nanovllm.models import build_model
from nanovllm.outputs import FlatLogprobs, Logprob, collector_paused
from nanovllm.sampling.sampler import Sampler

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
    and (rank 0) samples. An executor drives one runner per rank; a runner knows no other process, only the
    group its layers' collectives (and the KV block count) use."""

    def __init__(self, config: Config, rank: int = 0, group: TPGroup | None = None):
        self.config = config
        self.rank = rank
        self.group = group
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        # an 8-bit cache (read before it is allocated: warm-ups prefill first)
        self.fp8_cache = config.kv_cache_torch_dtype.itemsize == 1
        self.startup: dict[str, float] = {}  # seconds per start-up phase, logged at INFO
        # the Triton kernels behind the warm-ups (CompileTally; CUDA only: a CPU start imports no Triton)
        self.compiles: warmup.CompileTally | None = None
        with warmup.counting_compiles() if self.is_cuda else nullcontext() as self.compiles:
            self._start()
        if rank == 0:
            logger.info("start-up: %s%s", ", ".join(f"{k} {v:.1f}s" for k, v in self.startup.items()),
                        f"; {self.compiles}" if self.compiles is not None else "")

    def _start(self):
        config, group = self.config, self.group
        # Async scheduling with tensor parallelism: rank 0 broadcasts each step's sampled tokens, so that a worker
        # can take the next step's inputs from its own device copy (launch_chained) as rank 0 does. (Set first:
        # the CUDA warm-ups below run steps.)
        self.share_tokens = group is not None and bool(config.async_scheduling)
        self.last_step: PendingStep | None = None  # a worker's copy of the last step's tokens (share_tokens)
        if self.is_cuda:
            warmup.start_hashing_triton()  # (for the warm-ups' first compiles)
            with self._phase("CUDA init"):
                torch.cuda.set_device(self.device)
                torch.empty(1, device=self.device)  # creates the context
        with self._phase("load"):
            self.model = self._load_model()
            cpu_weights.pack(self.model)  # CPU float32: oneDNN's layout (a no-op elsewhere)
        self.lora = None  # enable_lora: the adapters' device slots (lora/stack.py), sized before the KV cache
        if config.enable_lora:
            from nanovllm.lora.stack import LoRAWeights
            self.lora = LoRAWeights(self.model, config)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = get_backend(config.attention_backend, config.device, is_fp8(config.kv_cache_torch_dtype))
        self.backend.check_head_dim(self.attn_layers[0].head_dim)
        self.backend.check_kv_cache_dtype(config.kv_cache_torch_dtype)
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler(config.hf_config.vocab_size, config.eos_token_ids, self.device,
                               logprobs_mode=config.logprobs_mode)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # small decode batches on CUDA: the model's forward with the ops between the linear layers folded into
        # their kernels (kernels/fused_step.py), where the model is one it takes
        self.fused_step = None
        if self.is_cuda:  # (a CPU start imports no Triton)
            from nanovllm.kernels.fused_step import FusedDecodeStep
            self.fused_step = FusedDecodeStep.build(self.model, config.torch_dtype, self.device)
        with self._phase("warm-up and KV sizing"):
            self.num_kvcache_blocks = kv_cache.count_blocks(self)
        with self._phase("KV allocation"):
            self.kv_cache, self.kv_scale = kv_cache.allocate(self, self.num_kvcache_blocks)
        self.graphs = self._capture_graphs()
        self.offloaded: dict[str, torch.Tensor] | None = None  # sleep(): the weights' host copies or empty shells

    def seed_sampler(self, seed: int) -> None:
        """Restart the generator that unseeded requests draw from at `seed` (data parallelism gives each replica its
        own)."""
        self.generator.manual_seed(seed)

    @contextmanager
    def _phase(self, name: str):
        start = time.perf_counter()
        yield
        if self.is_cuda:
            torch.cuda.synchronize()
        self.startup[name] = self.startup.get(name, 0.0) + time.perf_counter() - start

    def _load_model(self) -> nn.Module:
        cfg = self.config
        with _default_dtype(cfg.torch_dtype), self.device, building_for(self.group):
            model = self._build()
            if cfg.load_format == "dummy":
                init_dummy_weights(model, cfg.seed)
            else:
                load_weights(model, cfg.model)
            if cfg.quant is not None:  # the weights as the layers compute with them (CPU: dequantized)
                from nanovllm.quantization.fp8 import finish_loading
                finish_loading(model)
        return model.eval()

    def _build(self) -> nn.Module:
        """The model, its quantized layers' weights made as the checkpoint holds them (fp8: the 16-bit weights the
        layers would make are never allocated, so an fp8 model needs only its fp8 size to load)."""
        if self.config.quant is None:
            return build_model(self.config.hf_config)
        from nanovllm.quantization.fp8 import quantize_model
        with deferred_weights():
            model = build_model(self.config.hf_config)
        quantize_model(model, self.config.quant)
        return model

    def _capture_graphs(self, warm_up: bool = True):
        """Decode CUDA graphs, after a warm-up of every prefill kernel variant (they JIT here, not mid-run), the
        Triton kernels of both compiled ahead, in parallel (warmup.compile_ahead). Every bucket's forward runs
        there, those of cuda_graph.compile_buckets in the first pass: in Triton 3.6 a launch whose kernel is still
        compiling costs about 0.5 ms of host time, so the other buckets come after, in a second pass that finds
        their kernels compiled (and compiles any it does not, in parallel too)."""
        if not self.is_cuda:
            return None
        graphs = None
        if not self.config.enforce_eager:
            if self.backend.supports_cuda_graphs:
                from nanovllm.engine.cuda_graph import DecodeGraphs
                graphs = DecodeGraphs(self)  # the static buffers; no graph yet
            elif self.rank == 0:
                logger.warning("CUDA graphs are off (attention backend %s): decode runs eagerly", self.backend.name)
        if warm_up:
            prefills = warmup.prefill_variants(self)

            def forward_passes():
                for seqs in prefills:
                    warmup.forward(self, seqs)
                if graphs is not None:
                    graphs.forward(graphs.compile_first)
            with self._phase("kernel warm-up"):
                warmup.compile_ahead(forward_passes)
                if graphs is not None:
                    warmup.compile_ahead(lambda: graphs.forward(graphs.compile_later))
                for seqs in prefills:
                    warmup.prefill(self, seqs)
        if graphs is not None:
            with self._phase("graph capture"):
                graphs.capture()
        return graphs

    def release_graphs(self):
        """Destroy the decode graphs. With TP this must come before the NCCL group is torn down: NCCL keeps a
        reference for every graph that captured one of its collectives, and tearing down waits for them."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # ---- weights and memory, for RL loops (called on every rank through collective_rpc) -----------------
    def _layout_copy(self) -> nn.Module:
        """This rank's model on the meta device: same names, shards and loaders, no memory."""
        with _default_dtype(self.config.torch_dtype), torch.device("meta"), building_for(self.group):
            return self._build()

    def check_weights(self, weights: list | str, require_all: bool = False):
        """Raise ValueError/TypeError for a name or shape that does not fit (or, with require_all, a weight
        missing), without changing any weight: the same routing and checks as loading, against a meta copy."""
        load_named_weights(self._layout_copy(), weights, weights if isinstance(weights, str) else "update_weights",
                           require_all)

    @torch.inference_mode()
    def update_weights(self, weights: list | str, require_all: bool = False):
        """Copy (name, tensor) pairs, or a checkpoint directory's tensors, into this rank's shards in place (CUDA
        graphs keep pointing at the same memory; on CPU each packed float32 weight written is unpacked first and
        packed again after, into new storage: layers/cpu_weights.py)."""
        source = weights if isinstance(weights, str) else "update_weights"
        with cpu_weights.unpacked_on_write(self.model):
            load_named_weights(self.model, weights, source, require_all)
        if self.is_cuda:
            torch.cuda.synchronize()

    def sleep(self, level: int):
        """Free the KV cache and the decode graphs; level 1 keeps the weights in host memory (on CUDA; on CPU they
        stay where they are), level 2 frees them (update_weights brings new ones)."""
        self.release_graphs()
        self.backend.release()
        for layer in self.attn_layers:
            layer.bind(torch.tensor([]), torch.tensor([]))
        self.kv_cache = self.kv_scale = None
        if level == 2 or self.is_cuda:
            cpu_weights.unpack(self.model)
            self.offloaded = {}
            for name, param in self.model.named_parameters():
                if level == 1:
                    host = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                    self.offloaded[name] = host.copy_(param.data)
                else:  # keep only what a new allocation needs
                    self.offloaded[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        if self.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]):
        """Bring back what sleep freed: "weights" (copied back, or allocated uninitialized after level 2) and
        "kv_cache" (the same number of blocks; decode graphs are captured again)."""
        if "weights" in tags and self.offloaded is not None:
            params = dict(self.model.named_parameters())
            for name, saved in self.offloaded.items():
                params[name].data = torch.empty(saved.shape, dtype=saved.dtype, device=self.device)
                if saved.device.type != "meta":
                    params[name].data.copy_(saved)
            self.offloaded = None
        if "kv_cache" in tags and self.kv_cache is None:
            self.kv_cache, self.kv_scale = kv_cache.allocate(self, self.num_kvcache_blocks)
            self.graphs = self._capture_graphs(warm_up=False)
        if self.is_cuda:
            torch.cuda.synchronize()

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

    def _prepare_prefill(self, batch: ScheduledBatch) -> ForwardBatch:
        seqs = batch.seqs
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
        # With an fp8 cache attention reads every key and value back from it, new ones too (as vLLM's does): read
        # from the step's unquantized rows instead, a prompt's tokens would depend on whether its prefix was cached,
        # its prefill chunked, or another sequence of its batch had history
        paged = cu_seqlens_k[-1] > cu_seqlens_q[-1] or (self.fp8_cache and all(s.block_table for s in seqs))
        context = self.backend.prefill_context(self._to_device, cu_seqlens_q, cu_seqlens_k, slot_mapping,
                                               self._padded_tables(seqs) if paged else None)
        # each sequence's last new token: the only position whose logits are sampled (forks sample their parent's)
        last = [n - 1 for n in cu_seqlens_q[1:]]
        context.logits_indices = self._to_device(last + [last[row] for _, row in batch.forks], torch.int64)
        if self.lora is not None and any(seq.lora_slot >= 0 for seq in seqs):  # each token's adapter
            counts = [end - start for start, end in zip(cu_seqlens_q, cu_seqlens_q[1:])]
            context.lora_slots, context.lora_order = to_device_packed(
                self._to_device, step_slots([seq.lora_slot for seq in seqs], counts), torch.int32)
        fb = ForwardBatch(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                          context, None)
        if batch.prompt_logprobs:  # the first `count` new tokens of those sequences score the prompt
            rows = [r for i, count in batch.prompt_logprobs for r in range(cu_seqlens_q[i], cu_seqlens_q[i] + count)]
            fb.prompt_rows = self._to_device(rows, torch.int64)
        return fb

    def _prepare_decode(self, seqs: list[Sequence], rows: list[int] | None) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's tensors in two copies, and `rows` (_previous_rows) on the device (empty when None)."""
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1)
        lora = None  # (without enable_lora a step never walks its sequences for adapters)
        if self.lora is not None and any(seq.lora_slot >= 0 for seq in seqs):
            lora = step_slots([seq.lora_slot for seq in seqs], [1] * len(seqs))
        if self.graphs is not None and self.graphs.can_run(len(seqs)):  # straight into the graphs' buffers
            input_ids, positions, context, rows = self.graphs.stage(input_ids, positions, rows, slot_mapping,
                                                                    context_lens, self._padded_tables(seqs), lora)
            return ForwardBatch(input_ids, positions, context, None, staged=True), rows
        context = self.backend.decode_context(self._to_device, slot_mapping, context_lens, self._padded_tables(seqs))
        if lora is not None:
            context.lora_slots, context.lora_order = to_device_packed(self._to_device, lora, torch.int32)
        input_ids, positions, rows = to_device_packed(self._to_device, [input_ids, positions, rows or []],
                                                      torch.int64)
        return ForwardBatch(input_ids, positions, context, None), rows

    @staticmethod
    def _previous_rows(seqs: list[Sequence], previous: PendingStep) -> list[int] | None:
        """For each sequence, the row of `previous` whose sampled token is its input (-1: none); None if no
        sequence's input is."""
        source = {seq.seq_id: (row, index) for row, (seq, index)
                  in enumerate(zip(previous.batch.rows, previous.batch.out_index))}
        rows = []
        for seq in seqs:
            row, index = source.get(seq.seq_id, (-1, -1))
            rows.append(row if index == len(seq) - 1 else -1)  # is its input that step's output?
        return rows if any(row >= 0 for row in rows) else None

    def prepare(self, batch: ScheduledBatch, previous: PendingStep | None = None) -> ForwardBatch:
        """This step's tensors. Under async scheduling, a sequence whose input is the token `previous` sampled (still
        a placeholder on the host) takes it straight from the device."""
        seqs = batch.seqs
        for slot, request in batch.lora_loads:  # (on the stream after the steps before: none of them uses the slot)
            self.lora.load(slot, request)
        rows = self._previous_rows(seqs, previous) if previous is not None else None
        if batch.is_prefill:  # (the engine settles before a prefill: none takes tokens from `previous` today)
            fb = self._prepare_prefill(batch)
            rows_device = self._to_device(rows, torch.int64) if rows is not None else None
        else:
            fb, rows_device = self._prepare_decode(seqs, rows)
        if rows is not None:
            if not batch.is_prefill and rows == list(range(len(rows))):  # each sequence keeps its row (steady
                input_ids = previous.tokens[:len(rows)]  # decode): a view, no kernel
            else:
                input_ids = torch.where(rows_device >= 0, previous.tokens[rows_device.clamp(min=0)], fb.input_ids)
            if fb.staged:  # the graphs read their own buffer
                fb.input_ids.copy_(input_ids)
            else:
                fb.input_ids = input_ids.to(torch.int64)
        if self.rank == 0:
            fb.sampling = self.sampler.prepare(batch.rows, batch.sampled, self._to_device, batch.out_index)
        return fb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's hidden rows for this step (its Context set): the fused step where it takes the row count (and
        the step uses no LoRA adapter, which it does not apply)."""
        if (self.fused_step is not None and self.fused_step.accepts(input_ids.size(0))
                and get_context().lora_slots is None):
            return self.fused_step(input_ids, positions)
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def run_model(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [rows of logits_indices, vocab] on rank 0 (None on the other ranks)."""
        set_context(fb.context)
        if fb.staged:  # a decode step in the graphs' buffers (_prepare_decode, where a graph runs its batch size)
            hidden, logits = self.graphs.replay(fb.input_ids.size(0), fb.context.lora_slots is not None)
            if logits is not None:  # a small bucket's graph computes them (decode has no prompt rows); they live in
                return logits  # the graphs' pool until the next replay: this step's sampler is queued before it
        else:
            hidden = self.forward(fb.input_ids, fb.positions)
        if fb.prompt_rows is not None:
            fb.prompt_hidden = hidden[fb.prompt_rows]
        return self.model.compute_logits(hidden)

    def launch(self, batch: ScheduledBatch, previous: PendingStep | None = None) -> LaunchedStep | None:
        """Queue a step's forward pass (its block copies and prompt logprobs too) without waiting for it. Rank 0
        returns the step, to `sample`; the other ranks finish theirs here (with share_tokens: they take rank 0's
        sampled tokens, which the next step's inputs come from)."""
        try:
            fb = self.prepare(batch, previous)
            logits = self.run_model(fb)
            if batch.block_copies:
                self._copy_blocks(batch.block_copies)
            prompt_logprobs = self._prompt_logprobs(batch, fb) if batch.prompt_logprobs else None
        finally:
            reset_context()
        if self.rank != 0:
            if self.share_tokens:
                tokens = torch.empty(len(batch.rows), dtype=torch.int64, device=self.device)
                self.last_step = PendingStep(batch, self.group.broadcast(tokens, 0) if tokens.numel() else tokens,
                                             tokens)
            return None
        return LaunchedStep(batch, fb.sampling, logits, prompt_logprobs)

    def sample(self, step: LaunchedStep) -> PendingStep:
        """Sample a launched step's tokens on the device (rank 0), the logits processors' bookkeeping included, and
        start copying them to the host: `settle` reads them."""
        try:
            tokens, logprobs = self.sampler(step.logits, step.sampling, self.generator)
            if self.share_tokens and tokens.numel():
                tokens = self.group.broadcast(tokens.to(torch.int64).contiguous(), 0)
            pending = PendingStep(step.batch, tokens, self._to_host(tokens),
                                  tuple(self._to_host(t) if t is not None else None for t in logprobs)
                                  if logprobs is not None else None, step.prompt_logprobs)
            if self.is_cuda:
                pending.ready = torch.cuda.Event()
                pending.ready.record()
        except BaseException:  # the step is sampled again: as if it had not been sampled
            self.sampler.rollback(step.sampling)
            raise
        return pending

    def launch_chained(self, batch: ScheduledBatch) -> None:
        """A worker's launch of the step rank 0 launched with `previous`: its inputs from this rank's copy of the
        previous step's tokens (share_tokens)."""
        return self.launch(batch, self.last_step)

    def settle(self, step: PendingStep) -> StepOutput:
        """Wait for a launched step's tokens (only for that step, not for what was launched after it)."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.tokens_host.tolist()
        logprobs = self._logprob_dicts(step.batch.rows, tokens, step.logprobs_host) if step.logprobs_host else None
        return StepOutput(tokens, logprobs, step.prompt_logprobs)

    # Prompt logprobs score many positions: their logits are made this many rows at a time, so a long prompt never
    # holds [tokens, vocab] float32 at once.
    PROMPT_LOGPROBS_CHUNK = 1024

    def _prompt_logprobs(self, batch: ScheduledBatch, fb: ForwardBatch) -> list[list[dict[int, float]]] | None:
        """Every rank computes the LM head over the scored rows (tensor parallelism gathers on rank 0); rank 0
        returns, per sequence of batch.prompt_logprobs, {token: logprob} for the prompt token each row scores,
        plus the k most likely (k = its prompt_logprobs), from the raw distribution (logits in a _logits
        logprobs_mode)."""
        hidden, k = fb.prompt_hidden, 0
        if self.rank == 0:
            targets, ks, flat = [], [], []
            for i, count in batch.prompt_logprobs:
                seq = batch.seqs[i]
                start = seq.num_cached_tokens + 1  # the tokens after the scored positions
                targets += seq[start : start + count] if count else []
                ks.append(seq.sampling_params.prompt_logprobs)
                flat.append(seq.sampling_params.flat_logprobs)
            k = max(ks)
            targets = self._to_device(targets, torch.int64)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for a in range(0, hidden.size(0), self.PROMPT_LOGPROBS_CHUNK):
            logits = self.model.compute_logits(hidden[a : a + self.PROMPT_LOGPROBS_CHUNK], all_rows=True)
            if self.rank != 0:
                continue
            values, ids, scored, rank = self.sampler.logprobs(logits, k, targets[a : a + logits.size(0)])
            chosen.append(scored)
            ranks.append(rank)
            if k:
                top_values.append(values)
                top_ids.append(ids)
        if self.rank != 0:
            return None
        chosen = torch.cat(chosen).tolist() if chosen else []
        ranks = torch.cat(ranks).tolist() if ranks else []
        # flat lists, row r's top k at r * k: a list per row would be one more object a row for the collector
        top_values = torch.cat(top_values).flatten().tolist() if top_values else []
        top_ids = torch.cat(top_ids).flatten().tolist() if top_ids else []
        targets, out, row = targets.tolist(), [], 0
        with collector_paused():
            for (_, count), seq_k, as_flat in zip(batch.prompt_logprobs, ks, flat):
                build = _flat_prompt_logprobs if as_flat else _prompt_logprob_dicts
                out.append(build(targets, chosen, ranks, top_ids, top_values, row, count, k, seq_k))
                row += count
        return out

    def run(self, batch: ScheduledBatch) -> StepOutput | None:
        """One step, waited for; rank 0 returns what `settle` returns, other ranks None."""
        step = self.launch(batch)
        if step is None:
            return None
        pending = self.sample(step)  # (which rolls back itself if it raises)
        try:
            return self.settle(pending)
        except BaseException:
            # its tokens are dropped and step() samples it again: a seeded request must draw the same numbers, and
            # penalties must count its token once
            self.sampler.rollback(step.sampling)
            raise

    def _copy_blocks(self, copies: list[tuple[int, int]]):
        """Copy whole KV blocks (every layer, K and V), after the step that wrote the sources."""
        src, dst = (self._to_device(list(ids), torch.int64) for ids in zip(*copies))
        for cache in (self.kv_cache, self.kv_scale):
            if cache is None:
                continue
            raw = cache.view(torch.uint8)  # as bytes: index copies need not support float8
            for layer in range(raw.size(1)):  # one layer at a time: the gathered copy is a temporary
                raw[:, layer, dst] = raw[:, layer, src]

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    @staticmethod
    def _logprob_dicts(seqs: list[Sequence], tokens: list[int], logprobs) -> list[dict[int, float] | None]:
        # (called for every step of a batch with logprobs: at batch 256 its Python takes about as long as the step's
        # sampling on the GPU; hence the zips and no per-row slicing at full width)
        top_values, top_ids, chosen, ranks = logprobs
        width = top_values.size(1) if top_values is not None else 0
        rows = zip(top_ids.tolist(), top_values.tolist()) if width else [((), ())] * len(seqs)
        out = []
        with collector_paused():
            for seq, (ids, values), token, logprob, rank in zip(seqs, rows, tokens, chosen.tolist(), ranks.tolist()):
                k = seq.sampling_params.logprobs
                if k is None:
                    out.append(None)
                    continue
                d = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids, values) if k == width else
                                                                zip(ids[:k], values[:k]), 1)}
                if token not in d:  # (outside the top k: with its rank)
                    d[token] = Logprob(logprob, rank)
                out.append(d)
        return out


def _prompt_logprob_dicts(targets: list[int], chosen: list[float], ranks: list[int], top_ids: list[int],
                          top_values: list[float], row: int, count: int, k: int, seq_k: int) -> list[dict]:
    """Rows row..row+count of a step's prompt logprobs (top ids and values flat, k a row) as {token: Logprob} dicts:
    each position's seq_k most likely (ranks 1..seq_k), then its prompt token where it is not among them."""
    if not seq_k:  # (the prompt tokens' own alone: lm-eval's scoring, RL's reference logprobs)
        return [{t: Logprob(v, rank)} for t, v, rank in zip(targets[row : row + count], chosen[row : row + count],
                                                           ranks[row : row + count])]
    out = []
    for r in range(row, row + count):
        d = {t: Logprob(v, rank) for rank, (t, v) in enumerate(zip(top_ids[r * k : r * k + seq_k],
                                                                  top_values[r * k : r * k + seq_k]), 1)}
        if targets[r] not in d:  # (outside the top k: with its rank)
            d[targets[r]] = Logprob(chosen[r], ranks[r])
        out.append(d)
    return out


def _flat_prompt_logprobs(targets: list[int], chosen: list[float], ranks: list[int], top_ids: list[int],
                          top_values: list[float], row: int, count: int, k: int, seq_k: int) -> FlatLogprobs:
    """The same rows as _prompt_logprob_dicts, as a FlatLogprobs."""
    if not seq_k:
        return FlatLogprobs(targets[row : row + count], chosen[row : row + count], ranks[row : row + count],
                            [None] * count, list(range(count)), list(range(1, count + 1)))
    out = FlatLogprobs()
    for r in range(row, row + count):
        ids = top_ids[r * k : r * k + seq_k]
        out.starts.append(len(out.token_ids))
        out.token_ids += ids
        out.logprobs += top_values[r * k : r * k + seq_k]
        out.ranks += range(1, seq_k + 1)
        if targets[r] not in ids:  # (outside the top k: with its rank)
            out.token_ids.append(targets[r])
            out.logprobs.append(chosen[r])
            out.ranks.append(ranks[r])
        out.ends.append(len(out.token_ids))
    out.decoded_tokens = [None] * len(out.token_ids)
    return out
