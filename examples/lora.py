"""LoRA adapters over one base model, in one batch: the base model and each adapter answer the same questions in a
single generate() call, then the adapters' answers are checked against transformers + PEFT.

    python examples/lora.py                              # two demo adapters PEFT makes for the bundled model
    python examples/lora.py --model DIR --adapter A1 --adapter A2   # your base model and PEFT adapter directories

The demo adapters are random (PEFT's init_lora_weights=False), not trained: they change the answers, which is all
they are for. Any adapter saved by PeftModel.save_pretrained works (adapter_config.json + adapter_model.safetensors).
Needs peft for the demo adapters and the check (`pip install peft`).
"""
import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from nanovllm.checkpoint.bundled import default_model_path  # noqa: E402
from nanovllm.checkpoint.loader import resolve_checkpoint  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a primary color."]


def demo_adapters(model: str, directory: str) -> list[str]:
    """Two PEFT adapters of `model`: rank 8 on attention, rank 16 with rsLoRA on q, v and the MLP."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = []
    for i, (rank, targets, rslora) in enumerate([(8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
                                                  (16, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                                                   True)]):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, use_rslora=rslora,
                            init_lora_weights=False)
        path = os.path.join(directory, f"adapter{i + 1}")
        get_peft_model(base, config).save_pretrained(path)
        paths.append(path)
    return paths


def adapter_rank(path: str) -> int:
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return max([config["r"], *(config.get("rank_pattern") or {}).values()])


def peft_tokens(model: str, adapter: str, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers + PEFT's greedy tokens, the reference."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def main():
    try:
        import peft  # noqa: F401  (the demo adapters and the check against transformers + PEFT)
    except ImportError:
        raise SystemExit("examples/lora.py makes its demo adapters and checks their tokens with PEFT: "
                         "pip install peft") from None
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the base model (default: the bundled SmolLM2-135M)")
    p.add_argument("--adapter", action="append", default=[], help="a PEFT adapter directory (repeatable)")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    model = resolve_checkpoint(args.model or default_model_path())  # (a .gguf file: its converted directory)
    adapters = args.adapter or demo_adapters(model, tempfile.mkdtemp(prefix="nanovllm-lora-"))
    requests = [LoRARequest(f"adapter{i + 1}", i + 1, path) for i, path in enumerate(adapters)]
    rank = max(16, *(adapter_rank(path) for path in adapters))  # (rank_pattern may raise a module's own rank)

    llm = LLM(model, enable_lora=True, max_loras=len(requests), max_lora_rank=rank)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in QUESTIONS]
    models = [None, *requests]  # every question under the base model and each adapter, all in one call
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([p for p in prompts for _ in models], sp, lora_request=models * len(prompts))
    for i, out in enumerate(outs):
        if i % len(models) == 0:
            print(QUESTIONS[i // len(models)])
        name = out.lora_request.lora_name if out.lora_request else "base"
        print(f"  [{name}] {out.outputs[0].text!r}")
    same = all(out.outputs[0].token_ids == peft_tokens(model, out.lora_request.lora_path, out.prompt_token_ids,
                                                       args.max_tokens)
               for out in outs if out.lora_request is not None)
    print(f"adapter tokens equal transformers + PEFT's: {same}")
    llm.exit()


if __name__ == "__main__":
    main()
