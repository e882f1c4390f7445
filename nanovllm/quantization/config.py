"""What a model's weights are quantized as: read from config.json's quantization_config (the checkpoint's own
format) or asked for with LLM(quantization="fp8") (16/32-bit weights quantized at load). Anything else is refused
with an error naming it."""
import os
import re
from dataclasses import dataclass, field

# LLM(quantization=...): None (the checkpoint's own format, if any), or a method name
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class QuantConfig:
    """FP8 (e4m3) weights with one float32 scale per `block` = (rows, columns) of the weight: columns None means a
    whole row (per-channel; a per-tensor scale is a per-channel one repeated); activations quantized on the fly
    per token (per-channel weights) or per token and group of `block[1]` columns (block-scaled weights), unless
    `activations` is False (a weight-only checkpoint). static_activations: activations are quantized with one fixed
    scale per layer instead, the checkpoint's `input_scale` (per-channel weights only). online: the checkpoint holds
    16/32-bit weights, quantized at load. ignore: module names left unquantized. kv_scales: the checkpoint carries
    static per-tensor KV-cache scales (a kv_cache_scheme), which the loader reads, checks and does not use (an fp8
    KV cache scales each token and head itself)."""

    method: str  # "fp8" or "compressed-tensors" (how the checkpoint names it)
    block: tuple[int, int | None] = (1, None)
    online: bool = False
    scale_name: str = "weight_scale"  # the checkpoint's name for the scales (Qwen's block format: weight_scale_inv)
    ignore: tuple[str, ...] = field(default=())
    activations: bool = True  # fp8 activations (False: 16-bit activations against fp8 weights)
    static_activations: bool = False  # (with activations) one checkpoint scale per layer (input_scale), not per token
    transformers_ignore: tuple[str, ...] = field(default=())  # modules_to_not_convert, also read as transformers does
    kv_scales: bool = False  # static KV-cache scales in the checkpoint (checked at load, not used)

    def quantizes(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` (a checkpoint module path) is quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):  # (matched from the start, as compressed-tensors matches)
                if re.match(pattern[3:], module_name):
                    return False
            elif f".{pattern}." in f".{module_name}.":  # the module, or one it is part of, by whole name segments
                return False
        return not any(_transformers_skips(pattern, module_name) for pattern in self.transformers_ignore)


def _transformers_skips(pattern: str, name: str) -> bool:
    """transformers' reading of a modules_to_not_convert entry (should_convert_module): a regex matched from the start
    of the name up to a module boundary ("model.layers.*.self_attn"), or a suffix of the name."""
    try:
        if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name):
            return True
    except re.error:  # (not a regex: a plain name)
        pass
    return name.endswith(pattern)


def quant_config(hf_config, quantization: str | None) -> QuantConfig | None:
    """The QuantConfig of a checkpoint (its config's quantization_config) and the quantization option; ValueError
    for a format or option nanovllm does not implement, naming it."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATION_METHODS))}, got "
                         f"{quantization!r}")
    spec = getattr(hf_config, "quantization_config", None)
    if spec is None:  # (compressed-tensors' earlier checkpoints name it compression_config, which vLLM reads too)
        spec = getattr(hf_config, "compression_config", None)
    if spec is not None and not isinstance(spec, dict):
        spec = spec.to_dict() if hasattr(spec, "to_dict") else vars(spec)
    if not spec:
        if quantization == "compressed-tensors":
            raise ValueError("quantization='compressed-tensors' needs a checkpoint in that format (its config.json "
                             "has a quantization_config); for fp8 weights from a 16/32-bit checkpoint pass "
                             "quantization='fp8'")
        return QuantConfig("fp8", online=True) if quantization == "fp8" else None
    method = spec.get("quant_method")
    if method not in QUANTIZATION_METHODS:  # (first: saying to pass quantization=None would not help)
        raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which nanovllm does not "
                         "support; supported: 'fp8' (e4m3 weights, dynamic or static activations) and "
                         "'compressed-tensors' (float-quantized fp8)")
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint is quantized with {method!r} (its "
                         "config.json's quantization_config); pass quantization=None to load it as it is")
    online = _online_transforms(spec.get("transform_config"))
    if online:  # (the weights are stored rotated: without the rotation of x or y every product is wrong, silently)
        raise ValueError(f"the checkpoint's quantization_config has a transform_config with online rotations "
                         f"({', '.join(online[:3])}), which nanovllm does not implement: QuIP/SpinQuant-style "
                         "transforms of the activations at run time, without which its weights compute wrong results")
    return _fp8(spec) if method == "fp8" else _compressed_tensors(spec)


def check_quant_files(model: str, quant: QuantConfig | None):
    """ValueError for a checkpoint whose config.json names no quantization but which holds NVIDIA ModelOpt's
    hf_quant_config.json (its quantization config kept beside config.json, as vLLM reads it): its fp8 tensors would
    otherwise be refused one by one as lacking a quantization_config."""
    file = os.path.join(model, "hf_quant_config.json")
    if (quant is None or quant.online) and os.path.isfile(file):
        raise ValueError(f"{file} makes this a ModelOpt quantized checkpoint (its quantization config kept beside "
                         "config.json), which nanovllm does not support; it loads FP8 checkpoints in Qwen's and "
                         "compressed-tensors' formats (docs/quantization.md)")


def _online_transforms(transforms) -> list[str]:
    """compressed-tensors' transform_config: '<group> at <location>' for each transform applied at run time (to a
    layer's input or output, queries, the KV cache); those at weight_input / weight_output are fused into the stored
    weights, as vLLM reads them."""
    if not transforms:
        return []
    groups = (transforms.get("config_groups") or transforms.get("transform_groups")) if isinstance(transforms, dict) \
        else None
    if not isinstance(groups, dict):
        return [f"{transforms!r:.60}"]  # (a form not read here: not run without its rotations)
    online = []
    for name, scheme in groups.items():
        apply = scheme.get("apply") if isinstance(scheme, dict) else None
        for args in apply if isinstance(apply, list) else [None]:
            location = args.get("location") if isinstance(args, dict) else None
            if location not in ("weight_input", "weight_output"):
                online.append(f"{name} at {location}")
    return online


def _fp8(spec: dict) -> QuantConfig:
    where = "quantization_config (quant_method 'fp8')"
    if spec.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: fmt {spec['fmt']!r} is not supported; only 'e4m3'")
    scheme = str(spec.get("activation_scheme", "dynamic")).lower()  # (transformers lowercases it)
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}: activation_scheme {spec['activation_scheme']!r} is not supported; 'dynamic' or "
                         "'static'")
    kv = spec.get("kv_cache_scheme")
    if kv and str(kv).lower() != "static":  # (AutoFP8's "static": k/v_proj.output_scale tensors)
        raise ValueError(f"{where}: kv_cache_scheme {kv!r} is not supported; only 'static' (AutoFP8's per-tensor "
                         "KV-cache scales, which nanovllm checks and does not use: kv_cache_dtype='fp8' scales each "
                         "token and head itself)")
    block = spec.get("weight_block_size")
    # (as vLLM's Fp8Config: ignored_layers, AutoFP8's list of module names; transformers' modules_to_not_convert only
    # where there is none, then also read as transformers reads it)
    hf_ignore = () if spec.get("ignored_layers") else tuple(spec.get("modules_to_not_convert") or ())
    ignore = tuple(spec.get("ignored_layers") or ()) or hf_ignore
    static = scheme == "static"  # (AutoFP8's: a scalar input_scale per linear)
    if block is None:  # a scale per tensor
        return QuantConfig("fp8", ignore=ignore, transformers_ignore=hf_ignore, static_activations=static,
                           kv_scales=bool(kv))
    if static:  # (as vLLM: block-scaled weights quantize activations per token and group, on the fly)
        raise ValueError(f"{where}: activation_scheme 'static' with weight_block_size {block!r} is not supported; "
                         "static activation scales go with per-tensor weight scales (no weight_block_size)")
    if not _block_ok(block):
        raise ValueError(f"{where}: weight_block_size {block!r} is not supported; two powers of two, the columns' at "
                         "least 32 ([128, 128] in Qwen's FP8 checkpoints)")
    return QuantConfig("fp8", block=(block[0], block[1]), scale_name="weight_scale_inv", ignore=ignore,
                       transformers_ignore=hf_ignore, kv_scales=bool(kv))


def _block_ok(block) -> bool:
    """[rows, columns]: powers of two; columns at least 32 (the fp8 tl.dot's smallest K: kernels/fp8_gemm.py)."""
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 and b & (b - 1) == 0 for b in block)
            and block[1] >= 32)


def _compressed_tensors(spec: dict) -> QuantConfig:
    where = "quantization_config (compressed-tensors)"
    fmt = spec.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{where}: format {fmt!r} is not supported; only 'float-quantized' or 'naive-quantized' "
                         "(fp8 weights)")
    kv = _kv_cache_scheme(spec.get("kv_cache_scheme"), where)
    sparsity = spec.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":  # (weights stored as kept values and bitmasks: no `weight` tensor)
        raise ValueError(f"{where}: sparsity_config format {sparsity['format']!r} (compressed sparse weights) is not "
                         "supported; only 'dense' (sparse weights stored whole)")
    groups = spec.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: {len(groups)} config_groups; exactly one (every Linear quantized alike) is "
                         "supported")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("targets", ["Linear"]) != ["Linear"]:
        raise ValueError(f"{where}: targets {group.get('targets')!r}; only ['Linear']")
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ValueError(f"{where}: weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}; only "
                         "8-bit float (fp8) weights are supported")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise ValueError(f"{where}: asymmetric or dynamic weight scales are not supported")
    if group.get("output_activations") is not None:  # (their output_scale tensors would read as KV-cache scales)
        raise ValueError(f"{where}: output_activations (quantized layer outputs) are not supported; only weights and "
                         "input activations are quantized (a kv_cache_scheme gives static KV-cache scales)")
    strategy = _strategy(weights, "weights", where)
    static = _static_inputs(inputs, where)
    ignore, activations = tuple(spec.get("ignore") or ()), inputs is not None
    if strategy in ("channel", "tensor"):
        return QuantConfig("compressed-tensors", ignore=ignore, activations=activations, static_activations=static,
                           kv_scales=kv)
    if strategy == "block":
        if static:
            raise ValueError(f"{where}: static input activation scales with block-scaled weights are not supported; "
                             "static (strategy 'tensor') input scales go with 'channel' or 'tensor' weights")
        block = weights.get("block_structure")
        if not _block_ok(block):
            raise ValueError(f"{where}: block_structure {block!r} is not supported; two powers of two, the columns' "
                             "at least 32")
        return QuantConfig("compressed-tensors", block=(block[0], block[1]), ignore=ignore, activations=activations,
                           kv_scales=kv)
    raise ValueError(f"{where}: weight strategy {strategy!r} is not supported; 'channel', 'tensor' or 'block'")


def _static_inputs(inputs: dict | None, where: str) -> bool:
    """Whether compressed-tensors' input_activations are static: one fp8 scale per layer (strategy 'tensor',
    symmetric), the checkpoint's input_scale. False for dynamic fp8 activations or none; ValueError for any other
    (non-fp8, or static per channel, group or token, or asymmetric)."""
    if inputs is None:
        return False
    if (inputs.get("num_bits"), inputs.get("type")) != (8, "float"):
        raise ValueError(f"{where}: input activations of {inputs.get('num_bits')} bits, type {inputs.get('type')!r} "
                         "are not supported; only fp8 (8-bit float) activations, dynamic or static per tensor (or "
                         "none)")
    if inputs.get("dynamic", False):
        return False
    strategy = _strategy(inputs, "input activations", where)
    if strategy != "tensor":
        raise ValueError(f"{where}: static input activation scales with strategy {strategy!r} are not supported; "
                         "static input scales must be per tensor (strategy 'tensor'), or dynamic")
    if not inputs.get("symmetric", True):
        raise ValueError(f"{where}: asymmetric static input activation scales (a zero point) are not supported; only "
                         "symmetric ones")
    return True


def _strategy(args: dict, what: str, where: str):
    """The strategy of compressed-tensors quantization args (a config group's weights or input_activations) as its
    QuantizationArgs reads them, and vLLM with it: the one named (in any case), or, where none is named, 'tensor'
    without a group_size, 'group' with a positive one, 'channel' with -1. ValueError for args compressed-tensors
    refuses when it infers the strategy: any other group_size, or a block_structure (which needs strategy 'block')."""
    strategy = args.get("strategy")
    if strategy is not None:
        return strategy.lower() if isinstance(strategy, str) else strategy
    if args.get("block_structure") is not None:
        raise ValueError(f"{where}: {what} with a block_structure but no strategy, which compressed-tensors refuses "
                         "(it reads no strategy as 'tensor', 'group' or 'channel' by the group_size; a "
                         "block_structure needs strategy 'block')")
    group_size = args.get("group_size")
    if group_size is None:
        return "tensor"
    if group_size == -1:
        return "channel"
    if isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0:
        return "group"
    raise ValueError(f"{where}: {what} with group_size {group_size!r} and no strategy, which compressed-tensors "
                     "refuses: it reads no strategy as 'tensor' without a group_size, 'group' with a positive one, "
                     "'channel' with -1")


# the one compressed-tensors kv_cache_scheme read: fp8, one static symmetric scale per tensor (llm-compressor's
# "-FP8-KV" checkpoints); an absent field takes compressed-tensors' default
_KV_CACHE_SCHEME = {"num_bits": (8, 8), "type": ("float", "int"), "strategy": ("tensor", "tensor"),
                    "dynamic": (False, False), "symmetric": (True, True)}  # field: (required, default)


def _kv_cache_scheme(scheme, where: str) -> bool:
    """Whether compressed-tensors' kv_cache_scheme gives the checkpoint static KV-cache scales (self_attn.k_scale,
    v_scale): True for 8-bit float, per tensor, static and symmetric; False for none; ValueError naming what
    differs for any other (int8, per-head or per-channel scales, dynamic, asymmetric), which those scales would not
    describe."""
    if not scheme:
        return False
    if not isinstance(scheme, dict):
        raise ValueError(f"{where}: kv_cache_scheme {scheme!r} is not supported; compressed-tensors' kv_cache_scheme "
                         "is a dict of quantization args")
    differs = [f"{key} {scheme.get(key, default)!r}" for key, (required, default) in _KV_CACHE_SCHEME.items()
               if scheme.get(key, default) != required]
    if differs:
        raise ValueError(f"{where}: kv_cache_scheme with {', '.join(differs)} is not supported; only static per-tensor "
                         "fp8 KV-cache scales (num_bits 8, type 'float', strategy 'tensor', dynamic false, symmetric "
                         "true), which nanovllm checks and does not use (kv_cache_dtype='fp8' scales each token and "
                         "head itself)")
    return True
