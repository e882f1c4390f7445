"""Model registry keyed by config.json's `architectures`.

Every family is the one shared decoder in decoder.py; a family is only the flags it sets."""
from collections.abc import Callable
from dataclasses import replace

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM, MoeSpec, layer_windows


def _silu(config):
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")


def _qwen3_flags(config) -> DecoderFlags:
    _silu(config)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qk_norm=True, qkv_bias=bias, o_bias=bias)


def _qwen2_flags(config) -> DecoderFlags:
    _silu(config)
    return DecoderFlags(qkv_bias=True)  # Qwen2 always has q/k/v biases and none on o_proj


def _llama_flags(config) -> DecoderFlags:
    _silu(config)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def _gemma_flags(config, qk_norm: bool) -> DecoderFlags:
    """Gemma 2 (qk_norm False) and Gemma 3: (1 + w) RMSNorms around each sublayer, scaled embeddings, a gelu-tanh
    MLP, query_pre_attn_scalar's attention scale, soft-capped scores and logits where the config says; without
    layer_types (transformers 4), Gemma 2's odd layers and every sliding_window_pattern-th layer of Gemma 3 are
    global."""
    act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not supported (Gemma's MLP: gelu_pytorch_tanh)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model's attention) is not supported: "
                         "nanovllm generates with causal attention")
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qk_norm=qk_norm, qkv_bias=bias, o_bias=bias, norm_offset=True, sandwich_norms=True,
                        embed_scale=True, gelu=True, query_scale=config.query_pre_attn_scalar ** -0.5,
                        # (Gemma 3 keeps the field but caps no scores: transformers and vLLM ignore it there)
                        attn_softcap=None if qk_norm else getattr(config, "attn_logit_softcapping", None) or None,
                        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
                        window_pattern=getattr(config, "sliding_window_pattern", None) or 6 if qk_norm else 2)


# MoE config fields that describe what this engine does not do: (field, value that is fine, why it is not).
# Qwen2-MoE's and DeepSeek's shared experts, DeepSeek-V3's sigmoid scores and grouped top-k.
_UNSUPPORTED_MOE = [
    ("shared_expert_intermediate_size", 0, "shared experts are not supported"),
    ("n_shared_experts", 0, "shared experts are not supported"),
    ("num_shared_experts", 0, "shared experts are not supported"),
    ("scoring_func", "softmax", "only softmax router scores are supported"),
    ("topk_method", "greedy", "only plain (greedy) top-k routing is supported"),
    ("n_group", 1, "grouped top-k routing is not supported"),
    ("topk_group", 1, "grouped top-k routing is not supported"),
]


def _moe_spec(config, intermediate_size: int, renormalize: bool) -> MoeSpec:
    """The experts of an MoE config; ValueError naming the field for one this engine would run wrongly."""
    for name, fine, why in _UNSUPPORTED_MOE:
        value = getattr(config, name, None)
        if value not in (None, fine):
            raise ValueError(f"{name}={value!r}: {why} (nanovllm's MoE layer is top-k softmax routing over "
                             "routed experts only)")
    # Qwen3-MoE's config (transformers 4) says num_experts, Mixtral's num_local_experts; transformers 5 maps both
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k!r} must be between 1 and the number of experts "
                         f"({num_experts})")
    _silu(config)
    return MoeSpec(num_experts, top_k, intermediate_size, renormalize)


def _qwen3_moe_flags(config) -> DecoderFlags:
    if not (getattr(config, "num_experts", None) or 0):  # transformers' rule: no experts, every layer dense
        return _qwen3_flags(config)
    moe = _moe_spec(config, config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)))
    return replace(_qwen3_flags(config), moe=moe)


def _mixtral_flags(config) -> DecoderFlags:
    return replace(_llama_flags(config), moe=_moe_spec(config, config.intermediate_size, renormalize=True))


MODEL_FLAGS: dict[str, Callable[[object], DecoderFlags]] = {
    "Qwen3ForCausalLM": _qwen3_flags,
    "Qwen2ForCausalLM": _qwen2_flags,
    "LlamaForCausalLM": lambda config: replace(_llama_flags(config), windows=False),  # also SmolLM2, and Llama 3
    # rope scaling via rope_settings
    "MistralForCausalLM": _llama_flags,  # the Llama decoder, with its sliding window where the config has one
    "Gemma2ForCausalLM": lambda config: _gemma_flags(config, qk_norm=False),  # soft-caps, alternating windows
    "Gemma3ForCausalLM": lambda config: _gemma_flags(config, qk_norm=True),  # local and global layers
    "Qwen3MoeForCausalLM": _qwen3_moe_flags,  # Qwen3 attention; experts, and dense layers where the config says
    "MixtralForCausalLM": _mixtral_flags,  # Mistral attention; experts in every layer
}


# Checkpoints nanovllm recognizes and does not run, with what to do instead.
REFUSED = {
    "Gemma3ForConditionalGeneration": "a multimodal Gemma 3 checkpoint (vision tower and language model): nanovllm "
                                      "runs text-only Gemma 3 checkpoints (Gemma3ForCausalLM, such as gemma-3-1b-it, "
                                      "or a text-only export of a larger one)",
}


def _architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if getattr(config, "text_config", None) is not None:  # (a composite config: the text model's fields sit inside)
        raise ValueError(f"config.json (architectures {archs}) nests a text_config, as a multimodal checkpoint's "
                         "does: nanovllm runs text-only checkpoints (for Gemma 3: Gemma3ForCausalLM, such as "
                         "gemma-3-1b-it, or a text-only export of a larger one)")
    for arch in archs:
        if arch in MODEL_FLAGS:
            return arch
    for arch in archs:
        if arch in REFUSED:
            raise ValueError(f"{arch} is not supported: {REFUSED[arch]}")
    raise ValueError(f"unsupported architecture {archs or '(config.json names none)'}; "
                     f"supported: {', '.join(MODEL_FLAGS)}")


def check_model_config(config) -> list[int]:
    """Fail early, before any weight is read, on a model this engine would run wrongly (the families' flags check
    their config; layer_types must cover every layer). Returns the sliding windows the layers use, each once, in
    increasing order ([] for none)."""
    flags = MODEL_FLAGS[_architecture(config)](config)
    return sorted({w for w in layer_windows(config, flags) if w})


def build_model(config) -> DecoderForCausalLM:
    """Build the model named by config.architectures (on the current default device and dtype)."""
    arch = _architecture(config)
    return DecoderForCausalLM(config, MODEL_FLAGS[arch](config))
