"""PEFT adapters for the LoRA tests, made by PEFT itself on a tiny checkpoint, and transformers + PEFT's greedy
tokens under one (the reference). Not collected (no test_ prefix)."""
import functools
import os

import torch


def make_adapter(base: str, path, rank: int, targets: list[str] | str, alpha: float = 16, use_rslora: bool = False,
                 seed: int = 0, scale: float = 1.0, **extra) -> str:
    """A LoRA adapter of `base` saved by PEFT into `path` (random A and B, B times `scale`); returns the path. A
    multimodal checkpoint's adapter is made on its whole ...ForConditionalGeneration, as PEFT users make one."""
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import load_hf_model
    model = load_hf_model(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                        init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(path)
    return os.fspath(path)


def edit_config(path: str, **changes) -> str:
    """Rewrite fields of an adapter's adapter_config.json (None deletes one)."""
    from tests.tiny_models import edit_json
    edit_json(os.path.join(path, "adapter_config.json"), **changes)
    return path


@functools.lru_cache(maxsize=8)
def _peft_model(base: str, adapter: str):
    from peft import PeftModel

    from tests.tiny_models import load_hf_model
    return PeftModel.from_pretrained(load_hf_model(base), adapter).eval()  # (PEFT changes the model it is given)


def peft_greedy(base: str, adapter: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers + PEFT's greedy continuation of `prompt_ids` under `adapter`."""
    model = _peft_model(base, adapter)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
