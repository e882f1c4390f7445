"""FP8 (e4m3) linear layers: the quant method a linear layer asks to make its weights, load them and multiply.

A quantized layer holds its weight as float8_e4m3fn [out, in] and one float32 scale per output row and group of
`block[1]` input columns ([out, groups]; a per-channel scale is one group, kept as [out]): a checkpoint's block
scales are repeated over their block's rows when loaded, so packed layers (q/k/v, gate/up) and tensor parallelism
shard scales exactly as they shard weights, whatever the sizes. Tensor parallelism splits a row-parallel layer's
groups too, so its per-rank input width must be a whole number of groups.

On CPU the weights are dequantized to float32 once loaded (the engine then runs the plain layer: the format logic is
what the CPU tests check); on CUDA they stay fp8 and `apply` runs kernels/fp8_gemm.py's product: activations
quantized on the fly (per token, or per token and group for block scales) for an fp8 GEMM, or left 16-bit against
the fp8 weight for small batches and weight-only checkpoints. MoE experts are dequantized as they are read
(dequantize_experts): the fused MoE kernel takes 16-bit experts."""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanovllm.quantization.config import QuantConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-channel) fp8: (w / scale in fp8, scale [rows] float32), scale = the row's |max| / 448."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    """float32 weight from fp8 `weight` [out, in] and `scale` ([out], or [out, groups] of `group` columns)."""
    w = weight.float()
    if scale.dim() == 1:
        return w * scale[:, None]
    return w * scale.repeat_interleave(group, dim=1)[:, :w.shape[1]]


class Fp8Linear:
    """One linear layer's fp8 method (layers/linear.py asks it through `layer.quant`)."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.block_rows, self.group = config.block
        self.scale_name = config.scale_name

    # ---- making and loading the weights ----------------------------------------------------------------
    def create_weights(self, layer: nn.Module, name: str):
        """Replace the layer's weight with an fp8 one and add its scales, loaded through the layer's own loaders
        (online quantization keeps the 16/32-bit weight until `finish`)."""
        if self.config.online:
            return
        out, inp = layer.weight.shape
        layer.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        if self.group is None:
            shape = (out,)
        else:
            if layer.tp_dim == 1 and layer.tp_size > 1 and inp % self.group:
                raise ValueError(f"{name}: its input is split over {layer.tp_size} ranks into {inp} columns each, not "
                                 f"a whole number of the checkpoint's {self.group}-column scale blocks; use another "
                                 "tensor_parallel_size")
            shape = (out, -(-inp // self.group))
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = lambda param, loaded, shard_id=None: self._load_scale(layer, param, loaded, shard_id)
        setattr(layer, self.scale_name, scale)

    def _load_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id):
        """A checkpoint's scales for this layer (or one part of a packed one) as the layer keeps them: block rows
        repeated over their rows, a per-tensor scale over every row."""
        rows = _full_rows(layer, param, shard_id)
        loaded = loaded.float()
        if self.group is None:
            if loaded.numel() == 1:  # per tensor
                loaded = loaded.reshape(1).expand(rows)
            elif loaded.shape not in ((rows,), (rows, 1)):
                raise ValueError(f"scale shape {tuple(loaded.shape)} does not match the expected ({rows}, 1) (one "
                                 "scale per output channel)")
            loaded = loaded.reshape(rows)
        else:
            cols = param.shape[1] * (layer.tp_size if layer.tp_dim == 1 else 1)
            expected = (-(-rows // self.block_rows), cols)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"scale shape {tuple(loaded.shape)} does not match the expected {expected} (one per "
                                 f"{self.block_rows}x{self.group} block)")
            loaded = loaded.repeat_interleave(self.block_rows, dim=0)[:rows]
        if shard_id is None:
            layer.weight_loader(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard_id)

    def finish(self, layer: nn.Module) -> "Fp8Linear | None":
        """After loading: the method the layer keeps (None: a plain layer now). CPU: the weights dequantized to
        float32 (online: rounded through fp8 per channel, so the engine computes what fp8 weights give)."""
        if self.config.online:
            weight, scale = quantize_rows(layer.weight.data)
        else:
            weight, scale = layer.weight.data, getattr(layer, self.scale_name).data
            delattr(layer, self.scale_name)
        if not weight.is_cuda:
            layer.weight = nn.Parameter(dequantize(weight, scale, self.group), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
            return None
        layer.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = scale  # [out] or [out, groups], float32
        return self

    # ---- the product --------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from nanovllm.kernels.fp8_gemm import fp8_linear
        return fp8_linear(x, layer.weight, self.scale, self.group, bias, self.config.activations)


def _full_rows(layer: nn.Module, param: nn.Parameter, shard_id) -> int:
    """Output rows of the checkpoint tensor a (shard of a) layer's parameter is loaded from."""
    if shard_id is None:
        return param.shape[0] * (layer.tp_size if layer.tp_dim == 0 else 1)
    if isinstance(shard_id, str):  # q, k or v
        heads = layer.num_heads if shard_id == "q" else layer.num_kv_heads
        return heads * layer.head_dim * layer.tp_size
    return layer.output_sizes[shard_id]


def quantize_model(model: nn.Module, config: QuantConfig):
    """Give every linear layer the config quantizes an Fp8Linear (its weights made for loading); MoE routers stay
    16-bit, as in the checkpoints."""
    from nanovllm.layers.linear import LinearBase, ReplicatedLinear
    names = checkpoint_names(model)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
            if all(config.quantizes(n) for n in names.get(name, [name])):
                module.quant = Fp8Linear(config)
                module.quant.create_weights(module, name)


def checkpoint_names(model: nn.Module) -> dict[str, list[str]]:
    """Our packed module names -> the checkpoint modules packed in them (q/k/v_proj in qkv_proj...)."""
    packed = getattr(model, "packed_modules_mapping", {})
    names: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        sources = [src.rpartition(".")[2] for src, (dst, _) in packed.items() if dst == leaf]
        if sources:
            names[name] = [f"{parent}.{s}" if parent else s for s in sources]
    return names


_EXPERT = re.compile(r"(.*\.experts\.\d+\.\w+)\.(weight\w*)")


def dequantize_experts(weights: Iterable[tuple[str, torch.Tensor]], config: QuantConfig,
                       dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each MoE expert's fp8 weight and scale turned into one `dtype` weight: the fused
    MoE kernel takes 16-bit experts (the other layers keep fp8). ValueError naming an expert weight without its
    scale, or a scale of the wrong shape."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _EXPERT.fullmatch(name)
        if match is None or (match[2] == "weight" and tensor.dtype != FP8):
            yield name, tensor
            continue
        parts = pending.setdefault(match[1], {})
        parts[match[2]] = tensor
        if "weight" in parts and config.scale_name in parts:
            del pending[match[1]]
            yield f"{match[1]}.weight", _dequantize_expert(match[1], parts["weight"], parts[config.scale_name],
                                                           config).to(dtype)
    for module, parts in pending.items():
        missing = "weight" if "weight" not in parts else config.scale_name
        raise ValueError(f"checkpoint lacks {module}.{missing} (an fp8 expert weight needs its scale)")


def _dequantize_expert(module: str, weight: torch.Tensor, scale: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    n, k = weight.shape
    rows, cols = config.block
    scale = scale.float()
    if cols is None:
        if scale.numel() not in (1, n):
            raise ValueError(f"checkpoint tensor {module}.{config.scale_name}: shape {tuple(scale.shape)}, expected "
                             f"({n}, 1)")
        return weight.float() * scale.reshape(-1, 1)
    expected = (-(-n // rows), -(-k // cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"checkpoint tensor {module}.{config.scale_name}: shape {tuple(scale.shape)}, expected "
                         f"{expected} (one per {rows}x{cols} block)")
    return weight.float() * scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


def finish_loading(model: nn.Module):
    """Every quantized layer's weights as it computes with them (Fp8Linear.finish)."""
    from nanovllm.layers.linear import LinearBase
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant is not None:
            module.quant = module.quant.finish(module)
