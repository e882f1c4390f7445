"""Model registry keyed by config.json's `architectures`."""
from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM


def _llama_flags(config) -> DecoderFlags:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

MODEL_FLAGS = {
    "Qwen3ForCausalLM": lambda config: DecoderFlags(qk_norm=True, qkv_bias=bool(getattr(config, "attention_bias", False)),
                                                    o_bias=bool(getattr(config, "attention_bias", False))),
    "Qwen2ForCausalLM": lambda config: DecoderFlags(qkv_bias=True),
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": _llama_flags,
}

def build_model(config) -> DecoderForCausalLM:
    """Build the model named by config.architectures (on the current default device and dtype)."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_FLAGS:
            return DecoderForCausalLM(config, MODEL_FLAGS[arch](config))
    raise ValueError(f"unsupported architecture {archs or '(none given)'}; supported: {', '.join(MODEL_FLAGS)}")
