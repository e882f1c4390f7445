"""One decoder for the Llama family. Qwen3, Qwen2, Llama, Mistral, Gemma 2 and Gemma 3 differ only by the flags in
DecoderFlags (q/k RMSNorm, qkv bias, rope scaling, Gemma's norms and soft-caps), read from the Hugging Face config;
Qwen3-MoE and Mixtral add `moe`, and each layer's MLP is then dense or mixture-of-experts as the config says
(moe_layer). Each layer's attention may have a sliding window (layer_windows): models interleave local and global
layers, and a layer type may have its own rotary base (Gemma 3's local layers)."""
import functools
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.activation import GeluTanhAndMul, SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.moe import GATE, UP, SparseMoeBlock
from nanovllm.layers.rotary_embedding import RotaryEmbedding


@dataclass
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert (Qwen3-MoE: moe_intermediate_size; dense layers keep intermediate_size)
    renormalize: bool  # the top_k weights renormalized to sum to 1


@dataclass
class DecoderFlags:
    qk_norm: bool = False  # Qwen3: RMSNorm on each query and key head before rope
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool = False
    moe: MoeSpec | None = None  # mixture-of-experts MLP in the layers moe_layer picks
    windows: bool = True  # the config's sliding window applies (Llama's architecture has none: a stray field)
    window_pattern: int | None = None  # without layer_types: every window_pattern-th layer is global (Gemma)
    # Gemma 2 and 3
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 (q/k norms too)
    sandwich_norms: bool = False  # each sublayer's output normed before the residual add; a norm before the MLP
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    gelu: bool = False  # gelu-tanh MLP (SiLU otherwise)
    query_scale: float | None = None  # the attention scale (query_pre_attn_scalar ** -0.5), else head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores s -> cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)

    @property
    def llama_layers(self) -> bool:
        """The Llama layer (pre-norms, SiLU): what kernels/fused_step.py folds."""
        return not (self.norm_offset or self.sandwich_norms or self.embed_scale or self.gelu)


def rope_settings(config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling dict or None) from either the old or the transformers-5 config layout; a layer
    type's own parameters where the config keys them by layer type (Gemma 3; in transformers 4's layout its local
    layers' base is rope_local_base_freq, unscaled)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return float(config.rope_local_base_freq), None
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if theta is None:  # (transformers 5 leaves it so where code sets config.rope_scaling on a loaded config)
        raise ValueError(f"the model's rope parameters {params} have no rope_theta; give it beside the scaling")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and partial != 1:  # (vLLM rotates only that part of each head; transformers' families here
        # rotate the whole head without scaling, and fail with it)
        raise ValueError(f"partial_rotary_factor={partial}: rotary embeddings on part of each head are not "
                         "implemented (nanovllm rotates the whole head_dim)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("yarn", "llama3"):  # transformers' defaults: trained on max_position_embeddings, and YaRN's
        # factor the ratio of the two
        max_pos = getattr(config, "max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", max_pos)
        if rope_type == "yarn" and params.get("factor") is None and max_pos:
            params["factor"] = max_pos / params["original_max_position_embeddings"]
    return float(theta), (params if rope_type not in (None, "default") else None)


def context_length(config) -> int | None:
    """The positions the model takes, as vLLM's _get_and_verify_max_len reckons them: max_position_embeddings, times
    the factor of linear rope scaling (which stretches the positions trained on; not Gemma 3's, whose
    max_position_embeddings is its whole context already); with YaRN the original context times its factor (Qwen's
    model cards: 32,768 x 4 = 131,072)."""
    max_pos = getattr(config, "max_position_embeddings", None)
    _, scaling = rope_settings(config)
    rope_type = scaling and scaling.get("rope_type", scaling.get("type"))
    gemma3 = any(str(a).startswith("Gemma3") for a in getattr(config, "architectures", None) or ())
    if max_pos and rope_type == "linear" and not gemma3:
        return int(max_pos * scaling["factor"])
    if rope_type == "yarn" and scaling["original_max_position_embeddings"]:
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return max_pos


def moe_layer(config, layer: int) -> bool:
    """Whether layer `layer` has experts (of an MoE model): Qwen3-MoE's rule, which every Mixtral layer meets
    (its config has neither field)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(config, pattern: int | None = None) -> list[str]:
    """Each layer's attention type, "sliding_attention" or "full_attention": the config's layer_types; else, with a
    window, every `pattern`-th layer global (Gemma's rule in transformers 4's configs) or every layer sliding
    (Mistral)."""
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types has {', '.join(map(repr, unknown))}, which nanovllm does not implement; "
                             f"supported: {', '.join(map(repr, LAYER_TYPES))}")
        return list(types)
    if getattr(config, "sliding_window", None) is None:
        return ["full_attention"] * n
    return ["full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def layer_windows(config, flags: DecoderFlags) -> list[int | None]:
    """Each layer's sliding window in tokens (a query sees itself and the window - 1 keys before it), or None; all
    None where the family has no windows (flags.windows)."""
    window = getattr(config, "sliding_window", None) if flags.windows else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"sliding_window {window!r} is not a number of tokens (a positive int; null for none)")
    return [window if t == "sliding_attention" else None for t in layer_types(config, flags.window_pattern)]


@functools.lru_cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (once per dtype: no tensor made in each forward)."""
    return torch.tensor(value, dtype=dtype).item()


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, flags: DecoderFlags, rotary_emb: RotaryEmbedding, window: int | None = None):
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)  # may differ from hidden // num_heads (e.g. Qwen3)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=flags.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=flags.o_bias)
        self.rotary_emb = rotary_emb
        scale = flags.query_scale or self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, window, flags.attn_softcap)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, flags.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, flags.norm_offset)
        half = self.head_dim // 2
        # kernels/rope.py takes heads whose half is a power of two
        self.rope_kernel_fits = half & (half - 1) == 0

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """What comes between the projections: q/k norm, rotary, attention; [tokens, heads * head_dim]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        stored = False
        if q.is_cuda and self.rope_kernel_fits:  # one Triton kernel, in place (and the K/V store where it may)
            from nanovllm.kernels.rope import qk_norm_rope_
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            target = self.attn.store_target()
            q, k = qk_norm_rope_(q, k, positions, self.rotary_emb.cos_sin_cache, *norms,
                                 store=(v, *target) if target is not None else None,
                                 offset=self.qk_norm and self.q_norm.offset)
            stored = target is not None
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, stored=stored).flatten(1, -1)


class DecoderMLP(nn.Module):
    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=flags.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=flags.mlp_bias)
        self.act_fn = GeluTanhAndMul() if flags.gelu else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, flags: DecoderFlags, rotary_emb: RotaryEmbedding, layer: int,
                 window: int | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(config, flags, rotary_emb, window)
        moe = flags.moe
        if moe is not None and moe_layer(config, layer):
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                      moe.renormalize)
        else:
            self.mlp = DecoderMLP(config, flags)
        eps, offset = config.rms_norm_eps, flags.norm_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.sandwich = flags.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(self, positions, hidden, residual):
        if self.sandwich:  # Gemma: each sublayer's output is normed before it joins the stream (hidden is the
            # whole stream here: no residual is carried between layers)
            hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), None
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        self.flags = flags
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5 if flags.embed_scale else None
        # One cos/sin cache [context_length, head_dim] per rope setting: one for all layers, except where layer types
        # have their own (Gemma 3's local layers)
        caches: dict[str, RotaryEmbedding] = {}
        layers = []
        kinds = layer_types(config, flags.window_pattern)
        for i, (kind, window) in enumerate(zip(kinds, layer_windows(config, flags))):
            theta, scaling = rope_settings(config, kind)
            key = repr((theta, scaling))
            if key not in caches:
                caches[key] = RotaryEmbedding(head_dim_of(config), context_length(config), theta, scaling)
            layers.append(DecoderLayer(config, flags, caches[key], i, window))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, flags.norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:  # (the scale rounded to the model's dtype first, as transformers does)
            hidden = hidden * _rounded(self.embed_scale, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    # checkpoint module path (its last dotted segments) -> (our module name, shard id); see loader.route_weight
    packed_modules_mapping = {
        "self_attn.q_proj": ("qkv_proj", "q"),
        "self_attn.k_proj": ("qkv_proj", "k"),
        "self_attn.v_proj": ("qkv_proj", "v"),
        "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    # one expert's projection -> (stacked parameter of SparseMoeBlock.experts, shard); see loader.route_expert_weight
    expert_weights_mapping = {
        "gate_proj": ("gate_up_proj", GATE), "up_proj": ("gate_up_proj", UP), "down_proj": ("down_proj", 0),
        "w1": ("gate_up_proj", GATE), "w3": ("gate_up_proj", UP), "w2": ("down_proj", 0),  # Mixtral's names
    }
    module_aliases = {"block_sparse_moe": "mlp"}  # Mixtral checkpoints' name of the MoE MLP
    # checkpoint name prefix -> ours, None for tensors of the checkpoint that are not this model's (skipped unread);
    # see loader.load_named_weights. A multimodal checkpoint's language model sets it (models.LANGUAGE_MODEL_PREFIXES)
    checkpoint_prefixes: dict[str, str | None] = {}

    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        self.model = DecoderModel(config, flags)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.skip_weights = ()
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            self.skip_weights = ("lm_head.weight",)  # some tied checkpoints still store a copy

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, all_rows: bool = False) -> torch.Tensor | None:
        """Logits of the rows the step's Context asks for (all_rows: of every row given); soft-capped where the
        model says (Gemma 2)."""
        logits = self.lm_head(hidden, all_rows)
        cap = self.model.flags.final_softcap
        if cap and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
