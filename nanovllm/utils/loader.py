"""Read checkpoints: config, EOS ids and (hf_name, tensor) pairs from safetensors."""
import json
import os
from glob import glob
from typing import Iterator

import torch
from torch import nn


def load_hf_config(model: str):
    from transformers import AutoConfig
    if not os.path.isdir(model):
        raise ValueError(f"{model!r} is not a checkpoint directory (expected config.json and *.safetensors)")
    if not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"{model!r} has no config.json; is it a Hugging Face checkpoint directory?")
    return AutoConfig.from_pretrained(model)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def load_eos_token_ids(model: str, hf_config) -> list[int]:
    """Every EOS id named by generation_config.json or config.json (either may hold a list)."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    path = os.path.join(model, "generation_config.json") if os.path.isdir(model) else ""
    if path and os.path.exists(path):
        with open(path) as f:
            sources.insert(0, json.load(f).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def iter_safetensors(model: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model!r}")
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: nn.Module, path: str):
    """Route each checkpoint tensor to its parameter's weight_loader (packed q/k/v and gate/up too)."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    skip = set(getattr(model, "skip_weights", ()))
    loaded_names = set()
    for name, tensor in iter_safetensors(path):
        if name in skip or "rotary_emb.inv_freq" in name:
            continue
        for src, (dst, shard_id) in packed.items():
            if src in name:
                pname = name.replace(src, dst)
                param = params[pname]
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            pname = name
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
            param = params[pname]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded_names.add(pname)
    missing = [n for n in params if n not in loaded_names]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:8])}")


def init_dummy_weights(model: nn.Module, seed: int = 0):
    """Random weights for benchmarks: throughput does not depend on their values."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        param.data.normal_(0.0, 0.02, generator=gen)
