"""FP8 checkpoints for the quantization tests, made from a tiny random model exactly as each format specifies, and
the same model with those weights dequantized (transformers' reference). Not collected (no test_ prefix)."""
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "w1", "w2", "w3")  # (Mixtral's experts)


def _blockwise(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's / DeepSeek's recipe: a scale per (rows x cols) block, its |max| / 448; the weight divided by it."""
    n, k = w.shape
    pad = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols)
    pad[:n, :k] = w
    blocks = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    expanded = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
    return (w / expanded).clamp(-448, 448).to(FP8), scale


def _channelwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' channel strategy: a scale per output row, [rows, 1]."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w / scale).clamp(-448, 448).to(FP8), scale


def _tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the tensor (AutoFP8's, and compressed-tensors' tensor strategy): a 0-dim tensor."""
    scale = w.abs().amax().clamp(min=1e-12) / 448.0
    return (w / scale).clamp(-448, 448).to(FP8), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return q.float() * scale
    n, k = q.shape
    return q.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


QWEN_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {
                 "targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                             "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                       "dynamic": True}}}}


# static activation scales (a scalar input_scale per linear): AutoFP8's format (weight_scale and input_scale 0-dim),
# and llm-compressor's FP8 preset (compressed-tensors, static per-tensor input activations; scales of shape [1] there)
AUTOFP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
STATIC_INPUTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


def ct_config(inputs: dict | None = STATIC_INPUTS, **weights) -> dict:
    """CT_CONFIG with `inputs` as its input_activations and `weights` changed in its weights (strategy=...)."""
    group = CT_CONFIG["config_groups"]["group_0"]
    return {**CT_CONFIG, "config_groups": {"group_0": {
        **group, "weights": {**group["weights"], **weights}, "input_activations": inputs}}}


CONFIGS = {"qwen": QWEN_CONFIG, "compressed-tensors": CT_CONFIG, "autofp8": AUTOFP8_CONFIG,
           "ct-static-channel": ct_config(strategy="channel"), "ct-static-tensor": ct_config(strategy="tensor")}
STATIC = ("autofp8", "ct-static-channel", "ct-static-tensor")
# how the test checkpoints spread a packed layer's parts' input scales (calibration gives them one: one input), so
# that the scale a packed layer keeps (their max: v_proj's, up_proj's) is seen
SPREAD = {"k_proj": 1.25, "v_proj": 1.5, "up_proj": 1.25}


# static KV-cache scales (a kv_cache_scheme), one scalar per attention layer and name: llm-compressor's "-FP8-KV"
# checkpoints (compressed-tensors: the attention module's k_scale and v_scale, of shape [1]) and AutoFP8's
# kv_cache_scheme "static" (k/v_proj.output_scale, 0-dim; vLLM's fp8 config also reads q_proj.output_scale and
# self_attn.prob_output_scale, which these carry too)
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KV_SCALES = {"compressed-tensors": ("k_scale", "v_scale"),
             "autofp8": ("k_proj.output_scale", "v_proj.output_scale", "q_proj.output_scale", "prob_output_scale")}


def add_kv_scales(path, fmt: str, names: tuple[str, ...] | None = None) -> str:
    """Give a checkpoint of make_fp8's format `fmt` ("compressed-tensors" or "autofp8") static KV-cache scales as
    that format stores them: a kv_cache_scheme in its quantization_config, KV_SCALES[fmt] (or `names`) in each
    attention module (values that differ by layer and name; nanovllm checks them and does not use them)."""
    import json
    path = os.fspath(path)
    attention = sorted(n.removesuffix(".q_proj.weight") for n in load_file(os.path.join(path, "model.safetensors"))
                       if n.endswith("self_attn.q_proj.weight"))
    scales = {}
    for i, module in enumerate(attention):
        for j, name in enumerate(names or KV_SCALES[fmt]):
            value = torch.tensor(0.01 * (1 + i + j))
            scales[f"{module}.{name}"] = value.reshape(1) if fmt == "compressed-tensors" else value
    edit_tensors(path, replace=scales)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)["quantization_config"]
    scheme = KV_CACHE_SCHEME if fmt == "compressed-tensors" else "static"
    return edit_config(path, quantization_config={**config, "kv_cache_scheme": scheme})


def make_fp8(source: str, path, fmt: str, reference_path) -> tuple[str, str]:
    """(an fp8 checkpoint of `source` in format `fmt`, a float32 checkpoint of the same weights dequantized). fmt:
    "qwen" (128x128 blocks, weight_scale_inv), "compressed-tensors" (per channel, weight_scale, dynamic
    activations), or with static activation scales (input_scale, calibrated: input_scales) "autofp8" (per-tensor
    weight scales), "ct-static-channel" or "ct-static-tensor" (compressed-tensors, per channel or per tensor)."""
    path, reference_path = os.fspath(path), os.fspath(reference_path)
    for target in (path, reference_path):
        shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(source, file)))
    quantized, reference = {}, {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in PROJECTIONS and module[2] == "weight":
            if fmt == "qwen":
                q, scale = _blockwise(w.float(), 128, 128)
                quantized[name], quantized[name + "_scale_inv"] = q, scale
                reference[name] = dequantized(q, scale, (128, 128))
                continue
            q, scale = _tensorwise(w.float()) if fmt in ("autofp8", "ct-static-tensor") else _channelwise(w.float())
            quantized[name] = q
            quantized[name.replace(".weight", ".weight_scale")] = scale.reshape(1) if fmt == "ct-static-tensor" \
                else scale
            reference[name] = dequantized(q, scale, None)
        else:
            quantized[name] = reference[name] = w
    _save(reference_path, reference)
    if fmt in STATIC:
        quantized_modules = [n.rpartition(".")[0] for n in quantized if n.endswith(".weight_scale")]
        for module, scale in input_scales(reference_path, quantized_modules):
            quantized[f"{module}.input_scale"] = scale if fmt == "autofp8" else scale.reshape(1)
    _save(path, quantized)
    edit_config(path, quantization_config=CONFIGS[fmt])
    return path, reference_path


def _save(target: str, tensors: dict):
    for file in os.listdir(target):
        if file.endswith(".safetensors") or file.endswith(".safetensors.index.json"):
            os.remove(os.path.join(target, file))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(target, "model.safetensors"))


def input_scales(reference: str, modules: list[str]) -> list[tuple[str, torch.Tensor]]:
    """(module, 0-dim float32 input scale) for each of `modules`, calibrated as AutoFP8 and llm-compressor do: the
    |max| of the module's inputs over a few prompts (random token ids, as the tests' prompts), / 448; the parts of a
    packed layer spread by SPREAD. MoE experts, which transformers runs stacked rather than as modules, get 0.01 and
    up: nanovllm checks their scales but does not use them (its MoE kernel takes 16-bit activations)."""
    from tests.tiny_models import load_hf_model
    model = load_hf_model(reference)
    amax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda _, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item())))
        for name, module in model.named_modules() if name in modules]
    rng = random.Random(0)
    with torch.no_grad():
        for n in (8, 60, 200):
            model(torch.tensor([[rng.randrange(400) for _ in range(n)]]))
    for hook in hooks:
        hook.remove()
    scales = []
    for i, module in enumerate(modules):
        value = amax[module] / 448.0 if module in amax else 0.01 * (1 + i % 7)
        spread = SPREAD.get(module.rpartition(".")[2], 1.0)
        scales.append((module, torch.tensor(value * spread, dtype=torch.float32)))
    return scales


def edit_config(path: str, **changes) -> str:
    """Rewrite fields of a checkpoint's config.json (None deletes one)."""
    from tests.tiny_models import edit_json
    edit_json(os.path.join(path, "config.json"), **changes)
    return path


def edit_tensors(path: str, drop: tuple[str, ...] = (), replace: dict | None = None):
    """Remove tensors from (or replace them in) a checkpoint's model.safetensors."""
    file = os.path.join(path, "model.safetensors")
    tensors = {k: v for k, v in load_file(file).items() if k not in drop}
    tensors.update(replace or {})
    save_file(tensors, file)
