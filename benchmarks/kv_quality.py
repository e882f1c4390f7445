"""Greedy outputs with an fp8 KV cache against the 16/32-bit cache (docs/benchmarks.md, "FP8 KV cache"), or with
fp8 weights against the checkpoint's (--weights).

    python benchmarks/kv_quality.py                      # the bundled SmolLM2-135M, 32 chat prompts x 64 tokens
    python benchmarks/kv_quality.py --model PATH         # any checkpoint (random token prompts without a chat template)
    python benchmarks/kv_quality.py --weights            # quantization="fp8" against the checkpoint's weights

For each kv_cache_dtype (or fp8 weights): the share of prompts whose 64 greedy tokens equal the reference's token
for token, the median position of the first different token, and the mean and max |delta logprob| of the chosen
tokens while both agree. Runs on CPU (float32 model) or GPU (the model's dtype).
"""
import argparse
import os
import sys
from random import Random

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.checkpoint.bundled import default_model_path  # noqa: E402

TOPICS = ["the ocean", "Paris", "photosynthesis", "a cat", "the moon", "rain", "music", "bread", "a library",
          "winter", "volcanoes", "chess", "the internet", "bees", "a river", "mountains"]


def prompts_for(llm, count: int):
    if getattr(llm.tokenizer, "chat_template", None):
        questions = [f"Write two sentences about {t}." for t in TOPICS] + [f"What is {t}?" for t in TOPICS]
        return [llm._render_chat([{"role": "user", "content": q}], {}) for q in questions[:count]]
    rng = Random(0)
    return [[rng.randrange(min(llm.vocab_size, 10000)) for _ in range(rng.randint(16, 256))] for _ in range(count)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--weights", action="store_true", help="fp8 weights (quantization='fp8') against the checkpoint's")
    args = p.parse_args()
    model = args.model or default_model_path()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    variants = {"auto": {}, "fp8 weights": {"quantization": "fp8"}} if args.weights else \
        {dtype: {"kv_cache_dtype": dtype} for dtype in ("auto", "fp8", "fp8_e5m2")}
    outputs = {}
    for name, options in variants.items():
        with LLM(model, max_model_len=1024, kvcache_block_size=64, num_kvcache_blocks=1024, **options) as llm:
            outputs[name] = llm.generate(prompts_for(llm, args.prompts), sp, use_tqdm=False)
    for dtype in list(variants)[1:]:
        equal, firsts, deltas = 0, [], []
        for out, ref in zip(outputs[dtype], outputs["auto"]):
            a, b = out["token_ids"], ref["token_ids"]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), args.max_tokens)
            equal += first == args.max_tokens
            firsts.append(first)
            deltas += [abs(out["logprobs"][i][a[i]] - ref["logprobs"][i][b[i]]) for i in range(first)]
        mean = f"{sum(deltas) / len(deltas):.4f} max {max(deltas):.4f}" if deltas else "- (no agreeing token)"
        print(f"{dtype:11s} vs auto: {equal}/{len(firsts)} prompts equal for {args.max_tokens} tokens, median first "
              f"difference at token {sorted(firsts)[len(firsts) // 2]}, |delta logprob| mean {mean} over "
              f"{len(deltas)} agreeing tokens")


if __name__ == "__main__":
    main()
