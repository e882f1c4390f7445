"""Model registry keyed by config.json's `architectures`.

Every family is the one shared decoder in decoder.py; a family is only the flags it sets. A multimodal checkpoint
(MULTIMODAL) is served as its language model, one of these families, for text prompts."""
import copy
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


# Multimodal checkpoints whose language model nanovllm serves, for text prompts (as vLLM serves text prompts to them,
# without multi_modal_data): architecture -> (the language model's architecture, the model_type its text_config must
# have). The language model runs on the config's text_config (language_model_config); its tensors load under
# LANGUAGE_MODEL_PREFIXES, and the vision tower's and projector's are skipped unread.
MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),  # gemma-3-4b/12b/27b
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral"),  # Mistral Small 3.1 / 3.2
}
# A multimodal checkpoint's tensor names -> ours (checkpoint name prefix -> our prefix; None: a tensor of the vision
# tower or the projector, which nanovllm skips unread). The original uploads (Google's, Mistral's), and transformers
# 5's save_pretrained, write language_model.model.* and language_model.lm_head.*; transformers 5's modules (a
# trainer's state_dict, update_weights) are model.language_model.* and lm_head.*.
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.", "language_model.lm_head.": "lm_head.", "model.language_model.": "model.",
    **dict.fromkeys(("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
                    None),
}
# Top-level fields naming tokens that stand for an image (Gemma 3's begin-of-image token opens the image's tokens)
IMAGE_TOKEN_FIELDS = ("image_token_index", "boi_token_index")


def language_model_config(config) -> tuple[object, dict[int, str]]:
    """(the config the engine runs, {token id: its config field} of the tokens that stand for an image). A text
    model's config is itself (and no image tokens). For a MULTIMODAL checkpoint: a copy of its text_config naming
    the multimodal architecture, with what the engine reads from the top level carried over: quantization_config
    (compression_config) and dtype where the text config has none, the top level's EOS ids before its own, and
    tie_word_embeddings false where either level says so (transformers ties a multimodal model's LM head by the top
    level's flag, whose class default is true, but unties a stored LM head that differs from the embedding, as
    Mistral Small's does: its text_config says untied)."""
    archs = getattr(config, "architectures", None) or []
    text = getattr(config, "text_config", None)
    arch = next((a for a in archs if a in MULTIMODAL), None)
    if arch is None or text is None:
        return config, {}
    _, model_type = MULTIMODAL[arch]
    if getattr(text, "model_type", None) != model_type:
        raise ValueError(f"{arch}'s text_config has model_type {getattr(text, 'model_type', None)!r}: nanovllm serves "
                         f"its language model for text_config model_type {model_type!r} only")
    text = copy.deepcopy(text)
    text.architectures = [arch]
    for name in ("quantization_config", "compression_config", "dtype"):
        if getattr(text, name, None) is None and getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    eos = [i for level in (config, text) for value in [getattr(level, "eos_token_id", None)]
           for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
    text.eos_token_id = list(dict.fromkeys(eos)) or None
    text.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False)) and \
        bool(getattr(config, "tie_word_embeddings", True))
    image_tokens = {getattr(config, name): name for name in IMAGE_TOKEN_FIELDS
                    if isinstance(getattr(config, name, None), int)}
    return text, image_tokens


def _architecture(config) -> str:
    """The registry's key for `config`: a family of MODEL_FLAGS, or a MULTIMODAL architecture (its language model's
    config, from language_model_config)."""
    archs = getattr(config, "architectures", None) or []
    if getattr(config, "text_config", None) is not None:  # (a composite config: the text model's fields sit inside)
        raise ValueError(f"config.json (architectures {archs}) nests a text_config, as a multimodal checkpoint's "
                         f"does: nanovllm serves the language model of {' and '.join(MULTIMODAL)} checkpoints (for "
                         "text prompts), and text-only checkpoints")
    for arch in archs:
        if arch in MODEL_FLAGS or arch in MULTIMODAL:
            return arch
    raise ValueError(f"unsupported architecture {archs or '(config.json names none)'}; "
                     f"supported: {', '.join([*MODEL_FLAGS, *MULTIMODAL])}")


def _flags(config, arch: str) -> DecoderFlags:
    return MODEL_FLAGS[MULTIMODAL[arch][0] if arch in MULTIMODAL else arch](config)


def check_model_config(config) -> list[int]:
    """Fail early, before any weight is read, on a model this engine would run wrongly (the families' flags check
    their config; layer_types must cover every layer). Returns the sliding windows the layers use, each once, in
    increasing order ([] for none)."""
    flags = _flags(config, _architecture(config))
    return sorted({w for w in layer_windows(config, flags) if w})


def num_experts(config) -> int:
    """The routed experts of each of the model's MoE layers; 0 for a model without experts."""
    moe = _flags(config, _architecture(config)).moe
    return moe.num_experts if moe else 0


def build_model(config) -> DecoderForCausalLM:
    """Build the model named by config.architectures (on the current default device and dtype)."""
    arch = _architecture(config)
    model = DecoderForCausalLM(config, _flags(config, arch))
    if arch in MULTIMODAL:  # (the language model of a multimodal checkpoint: its tensors' names)
        model.checkpoint_prefixes = LANGUAGE_MODEL_PREFIXES
    return model
