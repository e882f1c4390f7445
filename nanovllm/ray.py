"""Ray Data: batch inference across a cluster, in the shape of vLLM's `ray.data.llm` processors.

    from nanovllm.ray import build_processor
    proc = build_processor(model, engine_kwargs={"max_model_len": 4096},
                           sampling_params={"temperature": 0.6, "max_tokens": 256}, concurrency=4, num_gpus=1)
    out = proc(ray.data.read_json("prompts.jsonl"))   # a Dataset in, a Dataset out

Ray does the distribution: each of `concurrency` actors (placed by Ray's scheduler, `num_gpus` each) builds one LLM
and serves batches with it; a batch whose actor dies is retried on a restarted actor, and a batch's rows reach the
output only when the batch completes, so no row is lost or repeated. Ray is an optional dependency
(`pip install "nanovllm[ray]"`): this module imports without it and says how to install it when used.
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


# Arrow stores a column of dicts as a struct: a field some rows lack comes back as None or NaN, ints as floats when
# nulls are present, lists as numpy arrays.
_INT_FIELDS = {f.name for f in fields(SamplingParams) if f.init and "int" in str(f.type) and "float" not in str(f.type)}


def _fields(values: dict) -> dict:
    """A struct's fields as plain values, without those this row lacks (None, or NaN: NaN != NaN)."""
    plain = {k: _plain(k, v) for k, v in values.items()}
    return {k: v for k, v in plain.items() if v is not None and v == v}


def _plain(name: str, value):
    value = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, dict):  # a struct inside the struct: structured_outputs
        return _fields(value)
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _sampling_params(defaults: dict, overrides) -> SamplingParams:
    if overrides is None:
        return SamplingParams(**defaults)
    if not isinstance(overrides, dict):
        raise TypeError(f"a row's sampling_params must be a dict of SamplingParams fields, got {overrides!r:.80}")
    return SamplingParams(**{**defaults, **_fields(overrides)})


class NanoVLLMActor:
    """One Ray Data actor: one LLM, built once, reused for every batch it is given."""

    def __init__(self, model: str, engine_kwargs: dict, sampling_params: dict):
        from nanovllm.llm import LLM
        self.llm = LLM(model, **engine_kwargs)
        self.defaults = sampling_params

    def __call__(self, batch: dict) -> dict:
        """batch: columns as Ray Data gives them (numpy arrays); adds the OUTPUT_COLUMNS."""
        size = len(next(iter(batch.values())))
        prompts = []
        for i in range(size):
            messages = batch["messages"][i] if "messages" in batch else None
            if _present(messages):
                conversation = [dict(m) for m in _as_list(messages)]
                prompts.append(self.llm._render_chat(conversation, {}))
            else:
                prompt = batch["prompt"][i]
                prompts.append(prompt if isinstance(prompt, str) else [int(t) for t in _as_list(prompt)])
        overrides = batch.get("sampling_params")
        params = [_sampling_params(self.defaults, overrides[i] if overrides is not None and _present(overrides[i])
                                   else None) for i in range(size)]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        batch = dict(batch)
        batch["generated_text"] = [o["text"] for o in outs]
        batch["generated_token_ids"] = [o["token_ids"] for o in outs]
        batch["finish_reason"] = [o["finish_reason"] for o in outs]
        batch["num_cached_tokens"] = [o["num_cached_tokens"] for o in outs]
        return batch


def _present(value) -> bool:
    """False for a missing cell: None, or the NaN Arrow gives a row that lacks the column's field."""
    return value is not None and not (isinstance(value, float) and value != value)


def _as_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


class Processor:
    """Dataset -> Dataset: every input column kept, OUTPUT_COLUMNS added."""

    actor_class = NanoVLLMActor  # what each Ray actor runs (a subclass may add its own pre/post-processing)

    def __init__(self, model: str, engine_kwargs: dict, sampling_params: dict, concurrency: int, num_gpus: float,
                 batch_size: int, max_retries: int):
        self.model, self.engine_kwargs, self.sampling_params = model, engine_kwargs, sampling_params
        self.concurrency, self.num_gpus, self.batch_size, self.max_retries = concurrency, num_gpus, batch_size, \
            max_retries

    def __call__(self, dataset):
        _require_ray()
        return dataset.map_batches(
            self.actor_class, fn_constructor_kwargs=dict(model=self.model, engine_kwargs=self.engine_kwargs,
                                                      sampling_params=self.sampling_params),
            batch_size=self.batch_size, concurrency=self.concurrency, num_gpus=self.num_gpus,
            max_restarts=self.max_retries, max_task_retries=self.max_retries)


def build_processor(model: str, engine_kwargs: dict | None = None, sampling_params: dict | None = None,
                    concurrency: int = 1, num_gpus: float = 0, batch_size: int = 64, max_retries: int = 3) -> Processor:
    """A Ray Data processor running `concurrency` LLM replicas of `model` (a path every node can read).

    engine_kwargs: LLM options; sampling_params: the default SamplingParams fields (a row's own `sampling_params`
    dict overrides them); num_gpus: GPUs per replica (its tensor_parallel_size on GPU, 0 on CPU); batch_size: rows
    per batch an actor generates at once; max_retries: restarts of a dead actor and retries of its batch. Unknown or
    bad options raise here, before any actor starts."""
    engine_kwargs = dict(engine_kwargs or {})
    valid = [f.name for f in fields(Config) if f.init and f.name != "model"]
    unknown = sorted(set(engine_kwargs) - set(valid))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; valid options are: {', '.join(valid)}")
    sampling_params = dict(sampling_params or {})
    SamplingParams(**sampling_params)  # unknown fields raise TypeError, bad values ValueError
    for name, value, low in (("concurrency", concurrency, 1), ("batch_size", batch_size, 1),
                             ("max_retries", max_retries, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not isinstance(num_gpus, (int, float)) or isinstance(num_gpus, bool) or num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0 (GPUs per replica), got {num_gpus!r}")
    if num_gpus >= 1 and "tensor_parallel_size" not in engine_kwargs:
        engine_kwargs["tensor_parallel_size"] = int(num_gpus)
    if num_gpus == 0:
        engine_kwargs.setdefault("device", "cpu")
    return Processor(model, engine_kwargs, sampling_params, concurrency, num_gpus, batch_size, max_retries)
