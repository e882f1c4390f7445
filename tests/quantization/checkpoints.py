"""FP8 checkpoints for the quantization tests, made from a tiny random model exactly as each format specifies, and
the same model with those weights dequantized (transformers' reference). Not collected (no test_ prefix)."""
import os
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


def make_fp8(source: str, path, fmt: str, reference_path) -> tuple[str, str]:
    """(an fp8 checkpoint of `source` in format "qwen" (128x128 blocks, weight_scale_inv) or "compressed-tensors"
    (per channel, weight_scale), a float32 checkpoint of the same weights dequantized)."""
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
            else:
                q, scale = _channelwise(w.float())
                quantized[name], quantized[name.replace(".weight", ".weight_scale")] = q, scale
                reference[name] = dequantized(q, scale, None)
        else:
            quantized[name] = reference[name] = w
    for target, data in ((path, quantized), (reference_path, reference)):
        for file in os.listdir(target):
            if file.endswith(".safetensors") or file.endswith(".safetensors.index.json"):
                os.remove(os.path.join(target, file))
        save_file({k: v.contiguous() for k, v in data.items()}, os.path.join(target, "model.safetensors"))
    edit_config(path, quantization_config=QWEN_CONFIG if fmt == "qwen" else CT_CONFIG)
    return path, reference_path


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
