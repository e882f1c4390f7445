"""The decoder's forward at small decode batches, with the ops between the linear layers folded into the small-batch
linear kernels (gemv.py): the seam through which small-batch speed reaches the model without a second forward in it.

The model runner builds one from the model's own modules (it reads their weights at each call, so weight updates and
sleep/wake are seen) and calls it for the row counts it `accepts`; every other step runs the model. `build` declines
(returns None) for anything but a plain dense decoder on CUDA with 16-bit or fp8 weights (fp8: the one-row kernels
read them with their scales; 9-16 rows of fp8 weights run the model, whose w8a16 kernel measured faster there): a
capability that changes a linear layer (LoRA, other weight formats) or the layer's shape only has to make it
decline.

- One row (batch-1 decode): each RMSNorm and residual add runs inside the next projection's one-row kernel, and
  SiLU-and-mul inside the down projection's: three kernels fewer a layer. With tensor parallelism too (o_proj and
  down all-reduce as the row-parallel layers do).
- 9-16 rows (one GPU): the RMSNorm between two layers is split over the epilogue of the one before (residual add,
  h * w, sums of squares) and the end of the one after (rstd), and gate_up's epilogue does SiLU-and-mul: three
  kernels fewer a layer. (At 2-8 rows this is slower, so the model runs them.)
Measured gains: docs/kernels.md."""
import torch
from torch import nn

from nanovllm.distributed.group import all_reduce
from nanovllm.kernels.gemv import WeightScale, gemv_add_norm, gemv_folded, gemv_normed
from nanovllm.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    small_batch_rows,
)
from nanovllm.quantization.fp8 import Fp8Linear

FOLD_MIN_ROWS = 9  # fewest rows that take the split norm


class FusedDecodeStep:
    def __init__(self, model: nn.Module, rows_fold: bool):
        self.model = model.model  # the DecoderModel: embed_tokens, layers, norm
        self.rows_fold = rows_fold  # 9-16 rows folded too (one GPU)

    @classmethod
    def build(cls, model: nn.Module, dtype: torch.dtype, device: torch.device) -> "FusedDecodeStep | None":
        """A fused step for `model`, or None where it does not apply."""
        from nanovllm.models.decoder import DecoderAttention, DecoderMLP
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not layers:
            return None
        if not decoder.flags.llama_layers:  # Gemma's norms, scaled embeddings, gelu: not what the folds compute
            return None
        plain = (QKVParallelLinear, RowParallelLinear, MergedColumnParallelLinear)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (type(attn) is DecoderAttention and type(mlp) is DecoderMLP):  # MoE, other families: decline
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(type(lin) in plain and _takes(lin, dtype) for lin in linears):
                return None  # another layer or weight format: decline
        fp8 = any(lin.quant is not None for layer in layers  # (an ignore list may leave any of them 16-bit)
                  for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                              layer.mlp.down_proj))
        return cls(model, rows_fold=layers[0].self_attn.o_proj.tp_size == 1 and not fp8)

    def accepts(self, rows: int) -> bool:
        return rows == 1 or (self.rows_fold and FOLD_MIN_ROWS <= rows <= 16)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if not small_batch_rows(hidden, self.model.layers[0].self_attn.qkv_proj.weight):
            raise ValueError(f"FusedDecodeStep takes 1-16 unit-stride 16-bit rows, got {tuple(hidden.shape)} "
                             f"{hidden.dtype}")
        return self._one_row(positions, hidden) if hidden.shape[0] == 1 else self._rows(positions, hidden)

    def _one_row(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, residual = _normed(attn.qkv_proj, hidden, layer.input_layernorm, residual)
            hidden = attn.o_proj(attn.attend(positions, qkv))
            gate_up, residual = _normed(mlp.gate_up_proj, hidden, layer.post_attention_layernorm, residual)
            down = mlp.down_proj
            hidden = all_reduce(gemv_folded(gate_up, down.weight, down.bias if down.tp_rank == 0 else None,
                                            gated=True, scale=_scale(down)), down.tp_group)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _rows(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        layers = self.model.layers
        rows, residual = None, hidden
        x = layers[0].input_layernorm(hidden)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(x) if rows is None else gemv_normed(rows, *_weights(attn.qkv_proj))
            o = attn.attend(positions, qkv)
            norm = layer.post_attention_layernorm
            residual, rows = gemv_add_norm(o, *_weights(attn.o_proj), residual, norm.weight, norm.eps)
            act = gemv_normed(rows, *_weights(mlp.gate_up_proj), gated_out=True)
            if i + 1 < len(layers):
                norm = layers[i + 1].input_layernorm
                residual, rows = gemv_add_norm(act, *_weights(mlp.down_proj), residual, norm.weight, norm.eps)
            else:
                hidden, _ = self.model.norm(mlp.down_proj(act), residual)
        return hidden


def _normed(linear: LinearBase, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
    """(linear(norm(x [+ residual])), the new residual) from the one-row kernel (a column-parallel layer: no
    all-reduce)."""
    out = gemv_folded(x, linear.weight, linear.bias, norm=(norm.weight, norm.eps), residual=residual,
                      scale=_scale(linear))
    return out if residual is not None else (out, x)


def _takes(linear: LinearBase, dtype: torch.dtype) -> bool:
    """A weight of the model's 16-bit dtype, or an fp8 one with its scales (quantization/fp8.py)."""
    if linear.quant is None:
        return linear.weight.dtype == dtype
    return isinstance(linear.quant, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn


def _weights(linear: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight, linear.bias


def _scale(linear: LinearBase) -> WeightScale | None:
    """The fp8 weight's scales for the kernels, None for a 16-bit weight."""
    quant = linear.quant
    return None if quant is None else WeightScale(quant.scale, quant.group, quant.shared_rows)
