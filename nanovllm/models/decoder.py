"""One decoder for the Llama family. Qwen3, Qwen2, Llama and Mistral differ only by the flags in
DecoderFlags (q/k RMSNorm, qkv bias, rope scaling), read from the Hugging Face config; Qwen3-MoE and Mixtral add
`moe`, and each layer's MLP is then dense or mixture-of-experts as the config says (moe_layer)."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    one_row,
    small_batch_rows,
)
from nanovllm.layers.moe import GATE, UP, SparseMoeBlock
from nanovllm.layers.rotary_embedding import RotaryEmbedding

# Fewest rows that take DecoderModel.forward_rows (up to the small-batch kernel's 16). Measured on one H200 at
# Qwen3-0.6B's shapes (docs/benchmarks.md, 2026-12-04, thirtieth session), ms/token at contexts 512-640: the norms
# folded (without -> with): batch 16 1.177-1.187 -> 1.108-1.118, batch 12 1.098-1.130 -> 1.065-1.123, batch 8
# 1.079-1.089 -> 1.105-1.118 (slower), batch 4 0.986-1.034 -> 1.008-1.009, batch 2 0.966-0.985 -> 0.946-0.952;
# SiLU-and-mul in gate_up's epilogue on top: batch 16 1.118-1.119 -> 1.088-1.094, batch 12 about the same.
FOLD_MIN_ROWS = 9


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


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling dict or None) from either the old or the transformers-5 config layout."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if rope_type not in (None, "default") else None)


def moe_layer(config, layer: int) -> bool:
    """Whether layer `layer` has experts (of an MoE model): Qwen3-MoE's rule, which every Mixtral layer meets
    (its config has neither field)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, flags: DecoderFlags, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)  # may differ from hidden // num_heads (e.g. Qwen3)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=flags.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=flags.o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.fused_rope = None  # on CUDA: q/k norm and rotary in one Triton kernel, in place

    def use_compiled(self, enabled: bool = True):
        half = self.head_dim // 2
        self.fused_rope = None
        if enabled and half & (half - 1) == 0:
            from nanovllm.layers.kernels.rope import qk_norm_rope_
            self.fused_rope = qk_norm_rope_

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, project: bool = True) -> torch.Tensor:
        """Everything after the qkv projection: q/k norm, rotary, attention, and o_proj where `project`."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        stored = False
        if self.fused_rope is not None:  # (and the K/V store where Attention.store_target allows it)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            target = self.attn.store_target()
            q, k = self.fused_rope(q, k, positions, self.rotary_emb.cos_sin_cache, *norms,
                                   store=(v, *target) if target is not None else None)
            stored = target is not None
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, stored=stored).flatten(1, -1)
        return self.o_proj(o) if project else o


class DecoderMLP(nn.Module):
    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=flags.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=flags.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, flags: DecoderFlags, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, flags, rotary_emb)
        moe = flags.moe
        if moe is not None and moe_layer(config, layer):
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                      moe.renormalize)
        else:
            self.mlp = DecoderMLP(config, flags)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fuse_small = False  # CUDA: one row takes forward_small

    def use_compiled(self, enabled: bool = True):
        self.fuse_small = enabled and isinstance(self.mlp, DecoderMLP)

    def forward(self, positions, hidden, residual):
        if self.fuse_small and one_row(hidden, self.self_attn.qkv_proj.weight):
            return self.forward_small(positions, hidden, residual)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_small(self, positions, hidden, residual):
        """The same layer for one 16-bit row (batch-1 decode): both RMSNorms and residual adds run inside the next
        projection's kernel, SiLU-and-mul inside the down projection's (layers/kernels/gemv.py's one-row kernel,
        which holds the whole row of x anyway): three kernels fewer per layer."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_normed(hidden, self.input_layernorm, residual)
        hidden = attn.attend(positions, qkv)
        gate_up, residual = mlp.gate_up_proj.forward_normed(hidden, self.post_attention_layernorm, residual)
        return mlp.down_proj(gate_up, gated=True), residual


class DecoderModel(nn.Module):
    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_settings(config)
        # One cos/sin cache for all layers: [max_position_embeddings, head_dim].
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList([DecoderLayer(config, flags, rotary_emb, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fold_norms = False  # CUDA, one GPU, dense MLPs: FOLD_MIN_ROWS-16 rows take forward_rows

    def use_compiled(self, enabled: bool = True):
        self.fold_norms = (enabled and all(isinstance(layer.mlp, DecoderMLP) for layer in self.layers)
                           and self.layers[0].self_attn.o_proj.tp_size == 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if (self.fold_norms and hidden.shape[0] >= FOLD_MIN_ROWS
                and small_batch_rows(hidden, self.layers[0].self_attn.qkv_proj.weight)):
            return self.forward_rows(positions, hidden)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_rows(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The same layers for 2-16 16-bit rows on one GPU (small-batch decode), the RMSNorms between layers folded
        into the projections' kernels (layers/kernels/gemv.py's add_norm): o_proj and down add the residual and
        hand the next projection (gate_up, the next layer's qkv) its input with the norm folded in, and gate_up's
        epilogue does SiLU-and-mul: three kernels fewer a layer (the step runs two norm kernels, the first and the
        last)."""
        layers = self.layers
        rows, residual = None, hidden
        x = layers[0].input_layernorm(hidden)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(x) if rows is None else attn.qkv_proj.forward_from_normed(rows)
            o = attn.attend(positions, qkv, project=False)
            residual, rows = attn.o_proj.forward_add_norm(o, residual, layer.post_attention_layernorm)
            act = mlp.gate_up_proj.forward_from_normed(rows, gated_out=True)
            if i + 1 < len(layers):
                residual, rows = mlp.down_proj.forward_add_norm(act, residual, layers[i + 1].input_layernorm)
            else:
                hidden, _ = self.norm(mlp.down_proj(act), residual)
        return hidden


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
        """Logits of the rows the step's Context asks for (all_rows: of every row given)."""
        return self.lm_head(hidden, all_rows)
