"""The CPU path against transformers' own generate, same model, same process (issue #14's CPU rows).

    python benchmarks/cpu_vs_hf.py            # bundled SmolLM2-135M in float32: 32 prompts, then one prompt
    python benchmarks/cpu_vs_hf.py --model PATH --prompts 8 --max-tokens 64
    python benchmarks/cpu_vs_hf.py --repeat 3  # each engine three times, alternating; the best of each

Prompts are random token ids (lengths uniform in [32, 256]); every request generates exactly --max-tokens greedy
tokens (EOS ignored) in both engines; transformers runs the batch left-padded in one generate call.
"""
import argparse
import os
import sys
import time
from random import Random

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.checkpoint.bundled import default_model_path  # noqa: E402
from nanovllm.checkpoint.loader import resolve_checkpoint  # noqa: E402


def run_ours(llm, prompts, max_tokens) -> float:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - start)


def run_hf(model, prompts, max_tokens) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        seconds = time.perf_counter() - start
    return (out.size(1) - width) * len(prompts) / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="kvcache_block_size (default: the engine's)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each engine, alternating (a shared machine's speed drifts); the best is compared")
    args = p.parse_args()
    for name in ("prompts", "max_tokens", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from transformers import AutoModelForCausalLM
    model = args.model or default_model_path()
    kwargs = {"kvcache_block_size": args.block_size} if args.block_size else {}
    # the default KV budget (2 GiB): 0.5 GiB held 45 blocks of 256 tokens, too few for 32 sequences, and preempted
    llm = LLM(model, device="cpu", max_model_len=1024, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(model), dtype=torch.float32).eval()
    rng = Random(0)
    vocab = min(llm.vocab_size, 10000)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.prompts)]
    print(f"torch threads {torch.get_num_threads()}, block size {llm.config.kvcache_block_size}")
    for name, batch in ((f"{args.prompts} prompts", prompts), ("one prompt", prompts[:1])):
        runs = [(run_ours(llm, batch, args.max_tokens), run_hf(hf, batch, args.max_tokens)) for _ in range(args.repeat)]
        ours, theirs = max(r[0] for r in runs), max(r[1] for r in runs)
        each = "" if args.repeat == 1 else "  (runs: " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in runs) + ")"
        print(f"{name}: nanovllm {ours:7.1f} tok/s, transformers {theirs:7.1f} tok/s, ratio {ours / theirs:.2f}x{each}")
    llm.exit()


if __name__ == "__main__":
    main()
