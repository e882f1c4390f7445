"""vLLM's LLM(...) options, so that a vLLM script's constructor runs unchanged: each is taken at vLLM's default, mapped
to nanovllm's option where nanovllm has the feature, and refused by name, saying what is not supported, otherwise."""
from dataclasses import MISSING

# option -> vLLM's default; any other value raises, with the reason
DEFAULT_ONLY = {
    "tokenizer_mode": ("auto", "only the checkpoint's own (Hugging Face) tokenizer is used"),
    "code_revision": (None, "no remote code is run: nanovllm runs its own model code"),
    "swap_space": (4, "preempted sequences are recomputed, never swapped to host memory"),
    "cpu_offload_gb": (0, "weights are not offloaded to host memory"),
    "mm_processor_kwargs": (None, "nanovllm serves text prompts only"),
    # (and every modality at 0, vLLM's way to serve a multimodal checkpoint's text: _no_media)
    "limit_mm_per_prompt": (None, "nanovllm serves text prompts only; every modality's limit at 0 (vLLM's "
                                  "text-only setting, e.g. {'image': 0}) is accepted too"),
    "task": ("auto", "nanovllm generates text only (no pooling or embedding tasks)"),
    "runner": ("auto", "nanovllm generates text only"),
    "convert": ("auto", "nanovllm generates text only (no conversion to a pooling model)"),
    "override_pooler_config": (None, "no pooling models"),
    "compilation_config": (None, "nanovllm does not use torch.compile; enforce_eager=True (or vLLM's "
                                 "optimization_level=0, -O0) turns CUDA graphs off"),
    "pipeline_parallel_size": (1, "no pipeline parallelism: use tensor_parallel_size or data_parallel_size"),
    "distributed_executor_backend": (None, "ranks run in spawned processes (mp); for Ray use nanovllm.ray"),
    "calculate_kv_scales": (False, "an fp8 KV cache scales each token and head as it is written"),
    "speculative_config": (None, "no speculative decoding"),
    "allowed_local_media_path": ("", "nanovllm serves text prompts only"),
    "kv_transfer_config": (None, "no disaggregated prefill"),
    "logits_processors": (None, "use SamplingParams' logit_bias, allowed_token_ids or bad_words"),
    "skip_tokenizer_init": (False, "the tokenizer is loaded to find the stop tokens; to skip detokenizing, pass "
                                   "SamplingParams(detokenize=False)"),
    "kv_cache_memory_bytes": (None, "size the cache with gpu_memory_utilization or num_gpu_blocks_override"),
    "pooler_config": (None, "no pooling models"),
    "allowed_media_domains": (None, "nanovllm serves text prompts only"),
    "generation_config": ("auto", "the checkpoint's generation_config.json is always read for the defaults"),
    "override_generation_config": (None, "pass SamplingParams instead"),
    "scheduling_policy": ("fcfs", "requests are scheduled first come, first served"),
    "enable_prompt_embeds": (False, "prompts are text or token ids"),
    "model_impl": ("auto", "nanovllm runs its own model code"),
    "config_format": ("auto", "config.json (or the .gguf header) is read"),
    "profiler_config": (None, "no built-in profiler: wrap the generate() calls in torch.profiler.profile()"),
}
# other values that name what nanovllm does, accepted as the default is (an empty dict: nothing overridden, vLLM's
# default for some of these)
SAME_AS_DEFAULT = {"task": ("generate",), "runner": ("generate",), "convert": ("none",), "tokenizer_mode": ("hf",),
                   "config_format": ("hf",), "limit_mm_per_prompt": ({},),
                   "mm_processor_kwargs": ({},), "override_generation_config": ({},), "compilation_config": ({},)}
# accepted at any value: they change nothing here (trust_remote_code: nanovllm runs its own model code)
NO_EFFECT = ("trust_remote_code", "disable_custom_all_reduce", "enable_sleep_mode", "disable_log_stats",
             "max_logprobs", "guided_decoding_backend", "structured_outputs_config", "served_model_name",
             "use_tqdm_on_load", "max_parallel_loading_workers", "disable_cascade_attn",
             "max_seq_len_to_capture")  # (decode CUDA graphs cover every length up to max_model_len)
# how a Hugging Face Hub id is fetched (checkpoint/hub.py): taken by Config.from_kwargs before the options are checked
HUB_OPTIONS = ("revision", "tokenizer_revision", "hf_token", "download_dir")
# vLLM's name -> nanovllm's
ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}
# nanovllm options vLLM scripts pass as None for "the default"
NONE_MEANS_DEFAULT = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "seed", "block_size",
                      "kvcache_block_size", "num_gpu_blocks_override", "num_kvcache_blocks")


def same_value(value, default) -> bool:
    """Whether an option's value is `default`, of its type (1 is not True, 1.0 not 1)."""
    return type(value) is type(default) and value == default


def _no_media(limits) -> bool:
    """Whether vLLM's limit_mm_per_prompt allows no media at all: every modality at 0 (or {"count": 0, ...})."""
    return isinstance(limits, dict) and bool(limits) and all(
        (limit.get("count") if isinstance(limit, dict) else limit) == 0 for limit in limits.values())


def translate(model: str, kwargs: dict, defaults: dict) -> dict:
    """nanovllm's options from a mix of nanovllm's and vLLM's; ValueError naming an unsupported non-default one.
    `defaults`: nanovllm's options' defaults (Config's fields)."""
    out = {}
    for name, value in kwargs.items():
        ours = ALIASES.get(name, name)
        if same_value(value, defaults.get(ours, MISSING)):
            # nanovllm's default, as if left out, whichever name gives it: dataclasses.asdict(engine_args) gives every
            # option, so vLLM's name (block_size) or an option that sets this one (optimization_level=0) decides
            continue
        if name == "limit_mm_per_prompt" and _no_media(value):
            continue
        if name in DEFAULT_ONLY:
            default, reason = DEFAULT_ONLY[name]
            same = SAME_AS_DEFAULT.get(name, ())
            if value != default and value not in same:
                also = "".join(f" or {v!r}" for v in same)
                raise ValueError(f"{name}={value!r} is not supported: {reason} (vLLM's default {default!r}{also} is "
                                 "accepted)")
        elif name in NO_EFFECT:
            continue
        elif name == "tokenizer_revision":
            if value is not None and value != kwargs.get("revision"):
                raise ValueError(f"tokenizer_revision={value!r} is not supported: the tokenizer is read from the "
                                 "model's snapshot (its revision); leave tokenizer_revision None")
        elif name == "tokenizer":
            if value is not None and value != model:
                raise ValueError(f"tokenizer={value!r} is not supported: the tokenizer is read from the model's "
                                 "checkpoint; copy its files there")
        elif name == "enable_chunked_prefill":
            if value is False:
                raise ValueError("enable_chunked_prefill=False is not supported: a prompt longer than "
                                 "max_num_batched_tokens is always prefilled in chunks of that many tokens")
        elif name == "optimization_level":  # vLLM's -O0 to -O3
            if isinstance(value, bool) or value not in (0, 1, 2, 3):
                raise ValueError(f"optimization_level must be 0, 1, 2 or 3 (vLLM's -O0 to -O3), got {value!r}")
            if value == 0:  # no compilation and no CUDA graphs (1 to 3: CUDA graphs, as by default; no compilation)
                out.setdefault("enforce_eager", True)
        elif name == "disable_async_output_proc":
            if value:
                out["async_scheduling"] = False
        elif value is None and name in NONE_MEANS_DEFAULT:
            continue
        else:
            if out.get(ours, value) != value and ours in ALIASES.values():  # (vLLM's name and nanovllm's, both set)
                other = ours if name != ours else next(vllm for vllm, o in ALIASES.items() if o == ours)
                raise ValueError(f"{name}={value!r} and {other}={out[ours]!r} name one option (vLLM's name and "
                                 "nanovllm's); set one of them")
            out[ours] = value
    return out
