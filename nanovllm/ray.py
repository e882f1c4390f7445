"""Ray Data: batch inference across a cluster, in the shape of vLLM's `ray.data.llm` processors.

    from nanovllm.ray import build_processor
    proc = build_processor(model, engine_kwargs={"max_model_len": 4096},
                           sampling_params={"temperature": 0.6, "max_tokens": 256}, concurrency=4, num_gpus=1)
    out = proc(ray.data.read_json("prompts.jsonl"))   # a Dataset in, a Dataset out

Ray does the distribution: each of `concurrency` actors (placed by Ray's scheduler, `num_gpus` each) builds one LLM
and serves batches with it (Arrow tables: exact 64-bit ints); a batch whose actor dies is retried on a restarted
actor, and a batch's rows reach the output only when the batch completes, so no row is lost or repeated. Ray is an
optional dependency (`pip install "nanovllm[ray]"`): this module imports without it and says how to install it when
used.
"""
from dataclasses import fields

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason", "num_cached_tokens")
INSTALL_HINT = 'Ray Data is needed for nanovllm.ray: pip install "nanovllm[ray]"'


def _require_ray():
    try:
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e


def _sampling_params(defaults: dict, overrides) -> SamplingParams:
    if overrides is None:
        return SamplingParams(**defaults)
    if not isinstance(overrides, dict):
        raise TypeError(f"sampling_params must be a dict of SamplingParams fields, got {overrides!r:.80}")
    # a struct column holds every field any row sets: the fields this row lacks come as None
    return SamplingParams(**{**defaults, **_present_fields(overrides)})


def _present_fields(values: dict) -> dict:
    return {k: _present_fields(v) if isinstance(v, dict) else v for k, v in values.items() if not _missing(v)}


def _missing(value) -> bool:
    """A cell a row does not have: None (Arrow) or NaN (a column Ray could not make an Arrow type of, such as
    messages, is kept as Python objects, with NaN where a row lacks it)."""
    return value is None or (isinstance(value, float) and value != value)


def _actor_id() -> str | None:
    """This Ray actor's id (hex), or None outside an actor."""
    try:
        import ray
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # (no Ray, or no runtime context)
        return None


class NanoVLLMActor:
    """One Ray Data actor: one LLM, built once, reused for every batch it is given. Batches come as Arrow tables
    (exact 64-bit ints: a numpy batch turns an int column with gaps into float64, which rounds a seed such as
    2**60 + 1); every row is checked, with its position and id in the error, before any is generated."""

    def __init__(self, model: str, engine_kwargs: dict, sampling_params: dict):
        from nanovllm.llm import LLM
        actor = _actor_id()
        if engine_kwargs.get("seed") is None and actor is not None:  # (None: vLLM's "no seed given")
            # unseeded rows: each actor its own draws (one engine seed would repeat them from actor to actor). Fresh
            # random bits, not the actor id: an actor Ray restarts keeps its id, so a seed from the id repeated the
            # dead actor's draws on the batches it retried. (32 bits: a CPU generator keeps only a seed's low 32.)
            import os
            engine_kwargs = {**engine_kwargs, "seed": int.from_bytes(os.urandom(4), "little")}
        self.llm = LLM(model, **engine_kwargs)
        self.model = model
        self.defaults = sampling_params
        self._loras = {}  # a row's `model` naming an adapter -> its LoRARequest (ids from 1, as Ray numbers them)
        self._content_format = None

    def _request(self, i: int, row: dict) -> tuple:
        where = f"row {i} of its batch" + (f" (id={row['id']!r:.40})" if "id" in row else "")
        try:
            messages = row.get("messages")
            if not _missing(messages):
                from nanovllm.frontend import _conversations
                if self._content_format is None:  # (read from the template once, as chat()'s "auto")
                    self._content_format = self.llm._content_format(None, None)
                conversation = _conversations([messages], self._content_format)[0]
                # a chat ending in the assistant's message is a prefill to continue (Ray's ChatTemplateUDF), not a
                # turn to close and answer after; a tool result or user message last still gets the assistant's turn
                options = {"add_generation_prompt": False, "continue_final_message": True} \
                    if conversation[-1]["role"] == "assistant" else {}
                prompt = self.llm._render_chat(conversation, options)
            elif not _missing(row.get("prompt")):
                prompt = row["prompt"]
            else:
                raise ValueError("it has neither a prompt nor messages")
            overrides = row.get("sampling_params")
            params = _sampling_params(self.defaults, None if _missing(overrides) else overrides)
            self.llm.requests.check(prompt, params)  # the engine's own checks, here with the row named
            lora = self._lora(row.get("model"))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        return prompt, params, lora

    def _lora(self, name):
        """Ray's per-row LoRA: a `model` other than the processor's names an adapter (its directory); None for the
        base model. Ignoring it ran the row on the base model without a word."""
        if _missing(name) or name == self.model:
            return None
        if not self.llm.config.enable_lora:
            raise ValueError(f"its model {name!r} is not the processor's ({self.model!r}), so it names a LoRA "
                             "adapter: pass engine_kwargs enable_lora=True (and max_lora_rank), or drop the column")
        if name not in self._loras:
            from nanovllm.lora.request import LoRARequest
            self._loras[name] = LoRARequest(name, len(self._loras) + 1, name)
        return self._loras[name]

    def __call__(self, batch):
        """batch: a pyarrow Table as Ray Data gives it (batch_format="pyarrow"); returns it with the
        OUTPUT_COLUMNS added."""
        import pyarrow as pa
        requests = [self._request(i, row) for i, row in enumerate(batch.to_pylist())]
        outs = self.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False,
                                 lora_request=[r[2] for r in requests])
        columns = {"generated_text": ([o["text"] for o in outs], pa.string()),
                   "generated_token_ids": ([o["token_ids"] for o in outs], pa.list_(pa.int64())),
                   "finish_reason": ([o["finish_reason"] for o in outs], pa.string()),
                   "num_cached_tokens": ([o["num_cached_tokens"] for o in outs], pa.int64())}
        for name, (values, kind) in columns.items():
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(name, pa.array(values, type=kind))
        return batch


class Processor:
    """Dataset -> Dataset: every input column kept, OUTPUT_COLUMNS added."""

    actor_class = NanoVLLMActor  # what each Ray actor runs (a subclass may add its own pre/post-processing)

    def __init__(self, model: str, engine_kwargs: dict, sampling_params: dict, concurrency: int, num_gpus: float,
                 batch_size: int, max_retries: int | None):
        self.model, self.engine_kwargs, self.sampling_params = model, engine_kwargs, sampling_params
        self.concurrency, self.num_gpus, self.batch_size, self.max_retries = concurrency, num_gpus, batch_size, \
            max_retries

    def __call__(self, dataset):
        _require_ray()
        import warnings

        from ray.data import ActorPoolStrategy
        retries = {}
        if self.max_retries is not None:  # Ray's own actor options, which Ray Data takes only through ray_remote_args
            retries = dict(max_restarts=self.max_retries, max_task_retries=self.max_retries)
        with warnings.catch_warnings():  # (ray_remote_args is deprecated: Ray Data has no named option for these)
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
            return dataset.map_batches(
                self.actor_class, fn_constructor_kwargs=dict(model=self.model, engine_kwargs=self.engine_kwargs,
                                                          sampling_params=self.sampling_params),
                batch_size=self.batch_size, batch_format="pyarrow", compute=ActorPoolStrategy(size=self.concurrency),
                num_gpus=self.num_gpus, **retries)


def build_processor(model: str, engine_kwargs: dict | None = None, sampling_params: dict | None = None,
                    concurrency: int = 1, num_gpus: float = 0, batch_size: int = 64,
                    max_retries: int | None = None) -> Processor:
    """A Ray Data processor running `concurrency` LLM replicas of `model` (a path every node can read, or a
    Hugging Face Hub id, which each node reads from its own cache or downloads).

    engine_kwargs: LLM options; sampling_params: the default SamplingParams fields (a row's own `sampling_params`
    dict overrides them); num_gpus: GPUs per replica (its tensor_parallel_size on GPU, 0 on CPU); batch_size: rows
    per batch an actor generates at once; max_retries: restarts of a dead actor and retries of its batch (None: Ray
    Data's own policy, which restarts dead actors and retries their batches). Unknown or bad options raise here,
    before any actor starts."""
    from nanovllm.vllm_options import HUB_OPTIONS, translate
    # vLLM's option names (Ray's vLLMEngineProcessorConfig takes vLLM's engine_kwargs), as LLM() maps them; an
    # unsupported non-default one raises ValueError naming it. Also drops vLLM's None-for-default values: seed=None
    # then leaves each actor its own seed instead of seed 0 on every actor.
    engine_kwargs = translate(model, dict(engine_kwargs or {}), Config.defaults())
    valid = [f.name for f in fields(Config) if f.init and f.name != "model"] + list(HUB_OPTIONS)
    unknown = sorted(set(engine_kwargs) - set(valid))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; valid options are: {', '.join(valid)}")
    sampling_params = dict(sampling_params or {})
    SamplingParams(**sampling_params)  # unknown fields raise TypeError, bad values ValueError
    for name, value, low in (("concurrency", concurrency, 1), ("batch_size", batch_size, 1),
                             ("max_retries", 0 if max_retries is None else max_retries, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not isinstance(num_gpus, (int, float)) or isinstance(num_gpus, bool) or not num_gpus >= 0:  # (NaN too)
        raise ValueError(f"num_gpus must be >= 0 (GPUs per replica), got {num_gpus!r}")
    if num_gpus >= 1 and "tensor_parallel_size" not in engine_kwargs:
        engine_kwargs["tensor_parallel_size"] = int(num_gpus)
    needs = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("data_parallel_size", 1)
    if num_gpus and needs > max(1, num_gpus):  # (an actor sees only its num_gpus GPUs: each would fail to start;
        # a fraction of one GPU shares it, as Ray means it, for a one-GPU engine)
        raise ValueError(f"each replica runs on {needs} GPUs (tensor_parallel_size x data_parallel_size), but "
                         f"num_gpus={num_gpus} gives it fewer: pass num_gpus={needs}")
    if num_gpus == 0:
        engine_kwargs.setdefault("device", "cpu")
    return Processor(model, engine_kwargs, sampling_params, concurrency, num_gpus, batch_size, max_retries)
