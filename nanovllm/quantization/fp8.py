"""FP8 (e4m3) linear layers: the quant method a linear layer asks to make its weights, load them and multiply.

A quantized layer holds its weight as float8_e4m3fn [out, in] and one float32 scale per output row and group of
`block[1]` input columns ([out, groups]; a per-channel scale is one group, kept as [out]): a checkpoint's block
scales are repeated over their block's rows when loaded, so packed layers (q/k/v, gate/up) and tensor parallelism
shard scales exactly as they shard weights, whatever the sizes. Tensor parallelism splits a row-parallel layer's
groups too, so its per-rank input width must be a whole number of groups. With quantization="fp8" (online) the
16/32-bit checkpoint is quantized per row as each tensor loads (a row-parallel layer's rows: this rank's part), and
the model is built with its linear and expert weights deferred (layers/linear.py's deferred_weights), so no 16-bit
copy of the quantized weights is ever allocated whole.

On CPU the weights are dequantized to the model's dtype once loaded (the engine then runs the plain layer: the format
logic is what the CPU tests check); on CUDA they stay fp8 and `apply` runs kernels/fp8_gemm.py's product: activations
quantized on the fly (per token, or per token and group for block scales) for an fp8 GEMM, or left 16-bit against the
fp8 weight for small batches and weight-only checkpoints. MoE experts (Fp8Experts) keep their stacked weights in fp8 the
same way, scales [experts, rows(, groups)], read by the fused MoE kernel against 16-bit activations.

Static activation scales (AutoFP8's activation_scheme "static", compressed-tensors' static per-tensor input
activations; per-channel or per-tensor weights only): each quantized layer loads its checkpoint modules' scalar
`input_scale` (one per packed module, the same on every rank), each checked finite and positive, and keeps their
maximum (the packed modules share one input, so the largest scale clips none of them; as vLLM does). On CUDA the
product quantizes x with that fixed scale instead of each token's own; 1-16 rows still read the fp8 weight against
x as it is, as for dynamic layers. On CPU, where activations are not quantized, the scale is checked and dropped;
MoE experts' scales likewise everywhere (the fused MoE kernel takes 16-bit activations).

Static KV-cache scales (a kv_cache_scheme: KV_SCALES) are checked and dropped everywhere: the model's
`checked_weights`, which the loader reads instead of routing them to a parameter."""

import torch
from torch import nn

from nanovllm.quantization.config import QuantConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-channel) fp8: (w / scale in fp8, scale [rows] float32), scale = the row's |max| / 448."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_into(weight: nn.Parameter, scale: torch.Tensor, placements: list[tuple], dtype: torch.dtype):
    """quantization="fp8": each (index, part) of a layer's `placements` of a 16/32-bit checkpoint tensor, rounded to
    the model's dtype on the weight's device, quantized per row into weight[index] and scale[index]. ValueError for
    an fp8 tensor (an fp8 checkpoint without its quantization_config)."""
    for index, part in placements:
        if part.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"is {part.dtype}, but quantization='fp8' quantizes a 16/32-bit checkpoint: an fp8 "
                             "checkpoint needs its quantization_config in config.json (then leave quantization unset)")
        q, row_scales = quantize_rows(part.to(weight.device, dtype))
        weight.data[index].copy_(q)
        scale[index].copy_(row_scales)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    """float32 weight from fp8 `weight` [..., out, in] and `scale` ([..., out] per row when group is None, else
    [..., out, groups] of `group` columns)."""
    w = weight.float()
    if group is None:
        return w * scale[..., None]
    return w * scale.repeat_interleave(group, dim=-1)[..., :w.shape[-1]]


class Fp8Linear:
    """One linear layer's fp8 method (layers/linear.py asks it through `layer.quant`)."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.block_rows, self.group = config.block
        self.block_scale: torch.Tensor | None = None  # (finish) the scales per 128 x 128 block, for cuBLASLt
        self.shared_rows = 1  # (finish) aligned rows that share their scales (gemv's WeightScale.rows)
        self.scale_name = config.scale_name
        self.input_scale: torch.Tensor | None = None  # (finish, static activations on CUDA) [1] float32

    # ---- making and loading the weights ----------------------------------------------------------------
    def create_weights(self, layer: nn.Module, name: str):
        """Give the layer an fp8 weight and its scales, loaded through the layer's own loaders (online: its
        checkpoint's 16/32-bit weights quantized per row as they load, one tensor at a time). Static activations:
        an `input_scale` too, one scalar per checkpoint module packed in the layer (the same on every rank)."""
        out, inp = layer.weight.shape
        # the model's dtype (built under it): online, weights are rounded to it before quantizing; on CPU, dequantized
        self.dtype = torch.get_default_dtype()
        layer.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8), requires_grad=False)
        if self.config.online:
            self.scale = torch.ones(out, dtype=torch.float32)  # (not a checkpoint tensor; dummy weights leave ones)
            layer.weight.weight_loader = (lambda param, loaded, shard_id=None: quantize_into(
                param, self.scale, layer.placements(param, loaded, shard_id), self.dtype))
            return
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
        if self.config.static_activations:
            from nanovllm.layers.linear import QKVParallelLinear
            parts = 3 if isinstance(layer, QKVParallelLinear) else len(getattr(layer, "output_sizes", [None]))
            layer.input_scale = nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
            layer.input_scale.weight_loader = _load_input_scale

    def _load_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id):
        """A checkpoint's scales for this layer (or one part of a packed one) as the layer keeps them: block rows
        repeated over their rows, a per-tensor scale over every row."""
        groups = None if self.group is None else param.shape[1] * (layer.tp_size if layer.tp_dim == 1 else 1)
        loaded = scales_per_row(loaded, _full_rows(layer, param, shard_id), groups, self.block_rows, self.group)
        if shard_id is None:
            layer.weight_loader(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard_id)

    def finish(self, layer: nn.Module) -> "Fp8Linear | None":
        """After loading: the method the layer keeps (None: a plain layer now). CPU: the weights dequantized to the
        model's dtype (online: rounded through fp8 per channel, so the engine computes what fp8 weights give)."""
        weight = layer.weight.data
        if self.config.online:
            scale = self.scale
        else:
            scale = getattr(layer, self.scale_name).data
            delattr(layer, self.scale_name)
        if self.config.static_activations:  # the packed modules share one input: the largest scale covers them all
            input_scale = layer.input_scale.data.max().reshape(1)
            delattr(layer, "input_scale")
        if not weight.is_cuda:  # (a static input scale is dropped: CPU runs 16/32-bit activations)
            layer.weight = nn.Parameter(dequantize(weight, scale, self.group).to(self.dtype), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
            return None
        layer.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = scale  # [out] or [out, groups], float32
        self.block_scale = self._block_scale(weight, scale)
        from nanovllm.kernels.gemv import shared_rows
        self.shared_rows = shared_rows(scale)
        if self.config.static_activations:
            self.input_scale = input_scale  # (a device tensor: CUDA graphs read it, no host sync)
        return self

    def _block_scale(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """The scales one per 128 x 128 block ([out / 128, groups]) where every 128 rows of this (packed, sharded)
        weight share theirs and cuBLASLt's block-scaled GEMM runs here; else None (the Triton block GEMM).
        cuBLASLt reads W's scales with their rows padded to 4 blocks, which _scaled_mm's layout cannot express: K
        must be a whole number of 512 columns (PyTorch #166752: silent wrong answers otherwise)."""
        from nanovllm.kernels.fp8_gemm import blockwise_scaled_mm_works
        from nanovllm.kernels.gemv import shared_rows
        out, inp = weight.shape
        if self.group != 128 or out % 128 or inp % 512 or not blockwise_scaled_mm_works(weight.device):
            return None
        return scale[::128].contiguous() if shared_rows(scale) == 128 else None

    # ---- the product --------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from nanovllm.kernels.fp8_gemm import fp8_linear
        return fp8_linear(x, layer.weight, self.scale, self.group, bias, self.config.activations,
                          self.block_scale, self.shared_rows, self.input_scale)


def scales_per_row(loaded: torch.Tensor, rows: int, groups: int | None, block_rows: int,
                   group: int | None) -> torch.Tensor:
    """A checkpoint's scales for a weight of `rows` rows as the layers keep them, float32: [rows] per channel (a
    per-tensor scale repeated), or [rows, groups] with each block row's scales repeated over its rows. ValueError
    for any other shape, or for a NaN or infinite scale (every product with its weight would be NaN or inf)."""
    loaded = loaded.float()
    if not torch.isfinite(loaded).all():
        raise ValueError("holds NaN or infinite scales: the checkpoint is damaged; re-download or re-quantize it")
    if group is None:
        if loaded.numel() == 1:  # per tensor
            return loaded.reshape(1).expand(rows)
        if loaded.shape not in ((rows,), (rows, 1)):
            raise ValueError(f"scale shape {tuple(loaded.shape)} does not match the expected ({rows}, 1) (one scale "
                             "per output channel)")
        return loaded.reshape(rows)
    expected = (-(-rows // block_rows), groups)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"scale shape {tuple(loaded.shape)} does not match the expected {expected} (one per "
                         f"{block_rows}x{group} block)")
    return loaded.repeat_interleave(block_rows, dim=0)[:rows]


_PARTS = {None: 0, "q": 0, "k": 1, "v": 2}  # where a checkpoint module's input scale goes in a layer's input_scale


def check_input_scale(loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's static activation scale as a 0-dim float32 tensor. ValueError unless it holds one value that
    is finite and positive (x / scale must be a number)."""
    return _check_scalar_scale(loaded, "input scale", "a static activation scale is one value per tensor (only "
                                                      "per-tensor static activation scales are supported)")


def check_kv_scale(loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's static KV-cache scale (kv_cache_scheme) as a 0-dim float32 tensor; ValueError unless it holds
    one finite positive value (a damaged or misread checkpoint, though nanovllm does not use the scale)."""
    return _check_scalar_scale(loaded, "static KV-cache scale", "a kv_cache_scheme's scale is one value per tensor "
                                                               "(strategy 'tensor')")


def _check_scalar_scale(loaded: torch.Tensor, what: str, one_value: str) -> torch.Tensor:
    if loaded.numel() != 1:
        raise ValueError(f"{what} of shape {tuple(loaded.shape)}: {one_value}")
    value = loaded.float().reshape(())
    if not (torch.isfinite(value) and value > 0):
        raise ValueError(f"{what} {value.item()} is not a finite positive number: the checkpoint is damaged; "
                         "re-download or re-quantize it")
    return value


# A checkpoint's static KV-cache scales (its config's kv_cache_scheme), by checkpoint name suffix, as vLLM maps them
# onto its attention layers: the attention module's k_scale / v_scale (compressed-tensors'; q_scale and prob_scale,
# for an fp8 attention, vLLM reads there too), AutoFP8's k/v_proj.output_scale (q_proj.output_scale and
# prob_output_scale: vLLM's fp8 config maps them too), and the attention's one kv_scale of AutoFP8's first FP8-KV
# checkpoints (mid-2024; vLLM still reads it, as k_scale and v_scale alike). Then the other names vLLM's loader maps
# there (its cache-scale mapper): vLLM's own (its attention module, self_attn.attn), a fused q/k/v projection's
# (qkv_proj.k_scale / v_scale), ModelOpt's (k_proj.k_scale, v_proj.v_scale: either projection with either scale)
# and HunYuan's (q.scale, k_cache.scale, v_cache.scale). Read, checked and dropped: nanovllm's KV cache holds the
# model's dtype, or fp8 with a scale per token and head.
KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.q_scale", "self_attn.prob_scale",
             "self_attn.kv_scale",
             "self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale", "self_attn.q_proj.output_scale",
             "self_attn.prob_output_scale",
             *(f"self_attn.attn.{name}_scale" for name in ("k", "v", "q", "prob")),
             "self_attn.qkv_proj.k_scale", "self_attn.qkv_proj.v_scale",
             *(f"self_attn.{proj}_proj.{name}_scale" for proj in "kv" for name in "kv"),
             "self_attn.q.scale", "self_attn.k_cache.scale", "self_attn.v_cache.scale")


def _load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
    """One checkpoint module's static activation scale into a layer's input_scale (its part of a packed layer:
    q/k/v or gate/up). Replicated: every rank reads the whole scalar."""
    param.data[_PARTS.get(shard_id, shard_id)] = check_input_scale(loaded)


def _load_expert_input_scale(experts: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
    """One expert's projection's static activation scale into [experts, projections] (checked, then dropped at
    finish)."""
    if shard_id is None:
        raise ValueError("stacked expert input scales (one tensor for every expert) are not supported; nanovllm "
                         "reads them per expert and projection, as the FP8 checkpoints store them")
    param.data[experts.expert_index(shard_id), shard_id[1]] = check_input_scale(loaded)


def _full_rows(layer: nn.Module, param: nn.Parameter, shard_id) -> int:
    """Output rows of the checkpoint tensor a (shard of a) layer's parameter is loaded from."""
    if shard_id is None:
        return param.shape[0] * (layer.tp_size if layer.tp_dim == 0 else 1)
    if isinstance(shard_id, str):  # q, k or v
        heads = layer.num_heads if shard_id == "q" else layer.num_kv_heads
        return heads * layer.head_dim * layer.tp_size
    return layer.output_sizes[shard_id]


class Fp8Experts:
    """A StackedExperts' fp8 method: gate_up_proj [E, 2I, H] and down_proj [E, H, I] in fp8, their scales kept as
    gate_up_scale [E, 2I(, H / group)] and down_scale [E, H(, I / group)] (block scales repeated over their rows, as
    Fp8Linear keeps them). Checkpoint scales load through the parameters `<weight>_<scale name>`, per expert and
    projection like the weights (tensor parallelism slices them alike); online, the 16-bit experts are quantized per
    row once loaded. CPU: dequantized at load. Static activations: each expert's projections' input_scale loads
    through `<weight>_input_scale` ([E, 2] gate and up, [E, 1] down) and is checked like a layer's, then dropped:
    the fused MoE kernel reads fp8 experts against 16-bit activations."""

    PARTS = ("gate_up_proj", "down_proj")

    def __init__(self, config: QuantConfig):
        self.config = config
        self.block_rows, self.group = config.block
        self.scale_name = config.scale_name

    def create_weights(self, experts: nn.Module, name: str):
        self.dtype = torch.get_default_dtype()  # (the model's, as Fp8Linear keeps it)
        if self.config.online:  # fp8 weights, filled by quantizing each checkpoint tensor per row as it loads
            self.online_scales = {}
            for part in self.PARTS:
                old = getattr(experts, part)
                weight = nn.Parameter(torch.empty(old.shape, dtype=FP8), requires_grad=False)
                weight.weight_loader = (lambda param, loaded, shard_id=None, part=part: quantize_into(
                    param, self.online_scales[part], experts.placements(part, param, loaded, shard_id), self.dtype))
                weight.shard_ids = old.shard_ids
                setattr(experts, part, weight)
                self.online_scales[part] = torch.ones(old.shape[:-1], dtype=torch.float32)
            return
        if self.group is not None and experts.tp_size > 1 and experts.intermediate % self.group:
            raise ValueError(f"{name}: its experts' intermediate size is split over {experts.tp_size} ranks into "
                             f"{experts.intermediate} columns each, not a whole number of the checkpoint's "
                             f"{self.group}-column scale blocks; use another tensor_parallel_size")
        for part in self.PARTS:
            old = getattr(experts, part)
            weight = nn.Parameter(torch.empty(old.shape, dtype=FP8), requires_grad=False)
            weight.weight_loader, weight.shard_ids = old.weight_loader, old.shard_ids
            setattr(experts, part, weight)
            e, rows, cols = old.shape
            shape = (e, rows) if self.group is None else (e, rows, -(-cols // self.group))
            scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = (lambda param, loaded, shard_id=None, part=part:
                                   self._load_scale(experts, part, param, loaded, shard_id))
            scale.shard_ids = old.shard_ids
            setattr(experts, f"{part}_{self.scale_name}", scale)
            if self.config.static_activations:  # (read and checked, not used: the experts take 16-bit activations)
                inputs = nn.Parameter(torch.empty(e, 2 if part == "gate_up_proj" else 1, dtype=torch.float32),
                                      requires_grad=False)
                inputs.weight_loader = (lambda param, loaded, shard_id=None:
                                        _load_expert_input_scale(experts, param, loaded, shard_id))
                inputs.shard_ids = old.shard_ids
                setattr(experts, f"{part}_input_scale", inputs)

    def _load_scale(self, experts: nn.Module, part: str, param: nn.Parameter, loaded: torch.Tensor, shard_id):
        """One expert's projection's checkpoint scales as the experts keep them (then the weight's own loader)."""
        if shard_id is None:
            raise ValueError("stacked fp8 expert scales (one tensor for every expert) are not supported; nanovllm "
                             "reads them per expert and projection, as the FP8 checkpoints store them")
        if part == "gate_up_proj":
            rows, cols = experts.intermediate * experts.tp_size, experts.hidden_size
        else:
            rows, cols = experts.hidden_size, experts.intermediate * experts.tp_size
        groups = None if self.group is None else -(-cols // self.group)
        loaded = scales_per_row(loaded, rows, groups, self.block_rows, self.group)
        getattr(experts, part).weight_loader(param, loaded, shard_id)

    def finish(self, experts: nn.Module) -> "Fp8Experts | None":
        """After loading: the method the experts keep (None on CPU, where they are dequantized to the model's dtype)."""
        scales = []
        for part in self.PARTS:
            if self.config.online:
                weight, scale = getattr(experts, part).data, self.online_scales.pop(part)
            else:
                weight, scale = getattr(experts, part).data, getattr(experts, f"{part}_{self.scale_name}").data
                delattr(experts, f"{part}_{self.scale_name}")
                if self.config.static_activations:
                    delattr(experts, f"{part}_input_scale")
            if not weight.is_cuda:
                weight = dequantize(weight, scale, self.group).to(self.dtype)
            new = nn.Parameter(weight, requires_grad=False)
            new.weight_loader, new.shard_ids = getattr(experts, part).weight_loader, getattr(experts, part).shard_ids
            setattr(experts, part, new)
            scales.append(scale)
        if not experts.gate_up_proj.is_cuda:
            return None
        self.gate_up_scale, self.down_scale = scales
        return self


def quantize_model(model: nn.Module, config: QuantConfig):
    """Give every linear layer the config quantizes an Fp8Linear, and every MoE layer's experts an Fp8Experts (their
    weights made for loading); MoE routers stay 16-bit, as in the checkpoints. With config.kv_scales the model checks
    the checkpoint's KV-cache scales and drops them (its `checked_weights`, which the loader reads)."""
    from nanovllm.layers.linear import LinearBase, ReplicatedLinear, allocate_deferred
    from nanovllm.layers.moe import StackedExperts
    if config.kv_scales:
        model.checked_weights = dict.fromkeys(KV_SCALES, check_kv_scale)
    names = checkpoint_names(model)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
            if _quantizes_all(config, name, [_aliased(model, source) for source in names.get(name, [name])]):
                module.quant = Fp8Linear(config)
                module.quant.create_weights(module, name)
        elif isinstance(module, StackedExperts) and _quantizes_all(
                config, name, _expert_sources(model, name, module.num_experts)):
            module.quant = Fp8Experts(config)
            module.quant.create_weights(module, name)
    allocate_deferred(model)  # the weights left 16-bit (a model built under deferred_weights)


def _quantizes_all(config: QuantConfig, name: str, sources: list[list[str]]) -> bool:
    """Whether the config quantizes the checkpoint modules packed into our layer `name` (each given by every name a
    checkpoint may use for it): all, or none. ValueError when its ignore list names only some (one layer holds one
    dtype)."""
    ignored = [next((n for n in names if not config.quantizes(n)), None) for names in sources]
    if all(n is None for n in ignored) or None not in ignored:
        return ignored[0] is None
    raise ValueError(f"the quantization_config's ignore list leaves {', '.join([n for n in ignored if n][:4])} "
                     f"unquantized but not the rest of {name}, which nanovllm holds as one layer ({len(sources)} "
                     "checkpoint modules): ignore all of them or none")


def _aliased(model: nn.Module, name: str) -> list[str]:
    """`name` (one of our module paths) and the other paths a checkpoint may give it (Mixtral's block_sparse_moe for
    our mlp, a multimodal checkpoint's language_model.model for our model: the model's module_aliases and
    checkpoint_prefixes read backwards)."""
    names = [name]
    for theirs, ours in getattr(model, "module_aliases", {}).items():
        segments = name.split(".")
        if ours in segments:
            names.append(".".join(theirs if s == ours else s for s in segments))
    return names + [theirs + n[len(ours):] for theirs, ours in getattr(model, "checkpoint_prefixes", {}).items()
                    for n in names if ours is not None and n.startswith(ours)]


def _expert_sources(model: nn.Module, name: str, num_experts: int) -> list[list[str]]:
    """Every checkpoint module stacked into the experts `name`, one expert's projection each, by every name a
    checkpoint may give it (Qwen3-MoE's mlp.experts.<e>.gate_proj, Mixtral's block_sparse_moe.experts.<e>.w1)."""
    projections: dict[tuple, list[str]] = {}  # (stacked parameter, shard) -> the checkpoints' names for it
    for proj, target in getattr(model, "expert_weights_mapping", {}).items():
        projections.setdefault(target, []).append(proj)
    return [[f"{prefix}.{e}.{proj}" for prefix in _aliased(model, name) for proj in projs]
            for e in range(num_experts) for projs in projections.values()]


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


def finish_loading(model: nn.Module):
    """Every quantized layer's weights as it computes with them (Fp8Linear.finish, Fp8Experts.finish)."""
    for module in model.modules():
        if getattr(module, "quant", None) is not None:
            module.quant = module.quant.finish(module)
