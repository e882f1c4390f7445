"""Model registry keyed by config.json's `architectures`.

Every family is the one shared decoder in decoder.py; a family is only the flags it sets."""
from collections.abc import Callable

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


def _qwen3_flags(config) -> DecoderFlags:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qk_norm=True, qkv_bias=bias, o_bias=bias)


def _qwen2_flags(config) -> DecoderFlags:
    return DecoderFlags(qkv_bias=True)  # Qwen2 always has q/k/v biases and none on o_proj


def _llama_flags(config) -> DecoderFlags:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


MODEL_FLAGS: dict[str, Callable[[object], DecoderFlags]] = {
    "Qwen3ForCausalLM": _qwen3_flags,
    "Qwen2ForCausalLM": _qwen2_flags,
    "LlamaForCausalLM": _llama_flags,  # also SmolLM2, and Llama 3 rope scaling via rope_settings
    "MistralForCausalLM": _llama_flags,  # the Llama decoder; sliding window checked in check_model_config
}


def _architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_FLAGS:
            return arch
    raise ValueError(f"unsupported architecture {archs or '(config.json names none)'}; "
                     f"supported: {', '.join(MODEL_FLAGS)}")


def check_model_config(config, max_model_len: int) -> None:
    """Fail early, before any weight is read, on a model this engine would run wrongly."""
    _architecture(config)
    # Sliding-window attention equals full attention while no sequence is longer than the window.
    # (Qwen2/Qwen3 configs set sliding_window to None unless use_sliding_window is on.)
    window = getattr(config, "sliding_window", None)
    if window is not None and window < max_model_len:
        raise ValueError(f"this model uses sliding-window attention (window {window} tokens), which nanovllm does "
                         f"not implement; pass max_model_len <= {window} (now {max_model_len}) so every sequence "
                         "fits in the window")


def build_model(config) -> DecoderForCausalLM:
    """Build the model named by config.architectures (on the current default device and dtype)."""
    arch = _architecture(config)
    return DecoderForCausalLM(config, MODEL_FLAGS[arch](config))
