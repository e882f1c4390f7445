"""config.json read with the json module alone, for the families whose transformers config classes are known here.

Loading a transformers config class can cost seconds (with transformers 5.17 each one runs `@auto_docstring`, which
imports the whole generation stack), and it sits on the engine's critical path. For Llama, Mistral, Qwen2 and Qwen3,
`read_plain_config` gives every field the engine reads (HF_CONFIG_FIELDS) the value transformers' config would give
it; where it cannot be sure of that it returns None, and the caller asks transformers. What it reproduces was read
from transformers 5.17 and 5.24 (identical for these fields): models/<family>/configuration_<family>.py and
PreTrainedConfig.__post_init__ (torch_dtype, rope). It does not repeat transformers' checks of fields the engine
never reads."""
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("nanovllm")

# Every attribute the engine reads from a model's config (models/, config.py, engine/, loader.py): what the plain
# reader must reproduce. tests/models/test_plain_config.py checks that the engine reads nothing else and that both
# readers agree on these.
HF_CONFIG_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "sliding_window", "eos_token_id", "dtype", "torch_dtype", "quantization_config", "compression_config",
    "text_config",
    # sliding windows and Gemma (models/decoder.py, models/__init__.py)
    "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
    "use_bidirectional_attention", "sliding_window_pattern", "rope_local_base_freq",
    # mixture of experts: the families' flags, decoder.moe_layer, tensor_parallel.check_tensor_parallel
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "n_shared_experts",
    "num_shared_experts", "scoring_func", "topk_method", "n_group", "topk_group",
)

# Keys with which transformers reads more than config.json's fields as they stand: remote code, another file,
# per-layer overrides, renamed attributes, rotary embeddings on part of each head, a nested model's config (a
# multimodal checkpoint's text_config, which transformers makes into its own config class).
_TRANSFORMERS_ONLY = ("auto_map", "configuration_files", "per_layer_config", "attribute_map", "partial_rotary_factor",
                      "text_config")

_DEFAULT_ROPE_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta (no family here overrides it)


class PlainConfig:
    """A model config as the engine sees it, with attribute access like a transformers config's. A field that
    transformers' config would not have is absent here too (getattr's default applies). Plain and at module level,
    so it pickles: it travels to tensor-parallel workers, data-parallel replicas and Ray actors."""

    def __init__(self, model_type: str, fields: dict):
        self.model_type = model_type
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__})"


class _NotPlain(Exception):
    """config.json holds something the plain reader cannot vouch for: transformers reads it."""


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v) -> bool:
    return _int(v) and v > 0


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


# What a value read for a class-declared field must be (else transformers' own validation is left to judge it).
_CHECKS: dict[str, Callable[[object], bool]] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "head_dim"), _positive_int),
    "rms_norm_eps": _positive_number,
    "hidden_act": lambda v: isinstance(v, str),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), lambda v: isinstance(v, bool)),
    "eos_token_id": lambda v: v is None or _int(v) or (isinstance(v, list) and all(_int(i) for i in v)),
    "sliding_window": lambda v: v is None or _positive_int(v),
    "architectures": lambda v: v is None or (isinstance(v, list) and all(isinstance(a, str) for a in v)),
}

# The engine reads these with no fallback of its own, and transformers' defaults for them are one model's sizes
# (num_key_value_heads': 32 for Qwen, 8 for Mistral, num_attention_heads for Llama): config.json must hold them.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")
# declared by PreTrainedConfig or by all four classes, with the default the engine assumes too
_SHARED_DEFAULTS = {"architectures": None, "hidden_act": "silu", "tie_word_embeddings": False}


@dataclass(frozen=True)
class _Family:
    """The engine's fields of one transformers config class. `required`: declared fields whose default is not what
    the engine does without them, so config.json must hold them; `defaults`: the other declared fields, with the
    class's default. A field the class does not declare is kept as config.json has it, or absent, as transformers
    keeps unknown keys."""
    required: tuple[str, ...]
    defaults: dict
    head_dim_from_heads: bool = False  # __post_init__: a missing or null head_dim is hidden_size // num_attention_heads
    window_needs_flag: bool = False  # __post_init__: sliding_window is None unless use_sliding_window is true


_FAMILIES = {
    # eos_token_id defaults to 2 (Llama 2's); the class refuses a hidden_size that heads do not divide
    "llama": _Family((*_REQUIRED, "eos_token_id"), {**_SHARED_DEFAULTS, "attention_bias": False, "mlp_bias": False},
                     head_dim_from_heads=True),
    # sliding_window defaults to 4096
    "mistral": _Family((*_REQUIRED, "eos_token_id", "sliding_window"), _SHARED_DEFAULTS, head_dim_from_heads=True),
    "qwen2": _Family(_REQUIRED, {**_SHARED_DEFAULTS, "eos_token_id": None}, window_needs_flag=True),
    # head_dim defaults to 128, not hidden_size // num_attention_heads
    "qwen3": _Family((*_REQUIRED, "head_dim"), {**_SHARED_DEFAULTS, "attention_bias": False, "eos_token_id": None},
                     window_needs_flag=True),
    # qwen3_moe and mixtral: transformers (attribute_map aliases num_experts, per-family MoE and rope defaults)
}


def read_config_json(checkpoint: str) -> dict:
    """config.json of checkpoint directory `checkpoint` as a dict; ValueError naming the file when it is not a JSON
    object."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e}); restore the checkpoint's config.json") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of config fields")
    return raw


def read_plain_config(checkpoint: str, raw: dict | None = None) -> PlainConfig | None:
    """config.json's fields (`raw`, else read from checkpoint directory `checkpoint`) as transformers' config would
    give the engine's fields, or None where only transformers can be sure of them (the reason is logged at DEBUG)."""
    if raw is None:
        raw = read_config_json(checkpoint)
    try:
        return _plain_config(raw)
    except _NotPlain as e:
        logger.debug("%s's config is read by transformers: %s", checkpoint, e)
        return None


def _plain_config(raw: dict) -> PlainConfig:
    model_type = raw.get("model_type")
    family = _FAMILIES.get(model_type)
    if family is None:
        raise _NotPlain(f"model_type {model_type!r}")
    for key in _TRANSFORMERS_ONLY:
        if key in raw:
            raise _NotPlain(f"it has {key!r}")
    if "layer_types" in raw and not family.window_needs_flag:  # (Llama and Mistral configs declare none)
        raise _NotPlain("layer_types")
    fields = {name: raw[name] for name in HF_CONFIG_FIELDS if name in raw}  # undeclared ones stay as they are
    for name in family.required:
        if name not in raw:
            raise _NotPlain(f"no {name!r}, and transformers' default is not what the engine assumes")
    for name, default in family.defaults.items():
        fields[name] = raw.get(name, default)
    for name in (*family.required, *family.defaults):
        if not _CHECKS[name](fields[name]):
            raise _NotPlain(f"{name}={fields[name]!r}")

    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    if family.head_dim_from_heads:
        if hidden % heads:
            raise _NotPlain(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = raw.get("head_dim")
        fields["head_dim"] = hidden // heads if head_dim is None else head_dim
        if not _positive_int(fields["head_dim"]):
            raise _NotPlain(f"head_dim={head_dim!r}")
    if family.window_needs_flag:
        use_window = raw.get("use_sliding_window", False)
        if not isinstance(use_window, bool):
            raise _NotPlain(f"use_sliding_window={use_window!r}")
        if use_window:  # transformers gives the windowed layers (layer_types, from max_window_layers)
            raise _NotPlain("use_sliding_window")
        fields["sliding_window"] = None
        fields["layer_types"] = ["full_attention"] * fields["num_hidden_layers"]
        if not _CHECKS["sliding_window"](fields["sliding_window"]):
            raise _NotPlain(f"sliding_window={fields['sliding_window']!r}")

    fields["dtype"] = fields["torch_dtype"] = _dtype(raw)
    fields.pop("rope_theta", None)  # transformers 5 moves it into rope_parameters, and rope_scaling is an alias
    fields["rope_parameters"] = fields["rope_scaling"] = _rope_parameters(raw)
    return PlainConfig(model_type, fields)


def _dtype(raw: dict) -> torch.dtype | None:
    """transformers 5's `dtype`: config.json's dtype, else its transformers-4 torch_dtype, as a torch.dtype."""
    name = raw.get("dtype")
    if name is None:
        name = raw.get("torch_dtype")
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _NotPlain(f"dtype {name!r}")
    return dtype


def _rope_parameters(raw: dict) -> dict:
    """transformers 5's rope_parameters for unscaled rope; any scaling is left to transformers."""
    if raw.get("rope_scaling") is not None:
        raise _NotPlain(f"rope_scaling {raw['rope_scaling']!r}")
    params = raw.get("rope_parameters")
    params = {} if params is None else params
    if not isinstance(params, dict) or set(params) - {"rope_type", "rope_theta"} or \
            params.get("rope_type", "default") != "default":
        raise _NotPlain(f"rope_parameters {params!r}")
    # rope_parameters' own theta first, then config.json's top-level one, then the default
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    if not _positive_number(theta):
        raise _NotPlain(f"rope_theta={theta!r}")
    return {"rope_theta": theta, "rope_type": "default"}
