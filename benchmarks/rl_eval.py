"""Throughput of the offline RL and evaluation jobs (docs/rl_and_eval.md), on one engine.

    python benchmarks/rl_eval.py samples   # bench.py's workload: 256 prompts, against 32 prompts x n=8
    python benchmarks/rl_eval.py scoring   # 1,000 prompts of 512 tokens, max_tokens=1, prompt_logprobs=0
    python benchmarks/rl_eval.py           # both

Random weights from the Qwen3-0.6B config unless --model is given; random prompt token ids.
"""
import argparse
import gc
import os
import sys
import time
from random import Random

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_CONFIG = os.path.join(HERE, "configs", "qwen3-0.6b")


def _random_prompts(rng: Random, count: int, lo: int, hi: int, max_id: int) -> list[list[int]]:
    return [[rng.randint(0, max_id) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _timed(llm, prompts, params) -> tuple[float, int, list[dict]]:
    """(seconds, prompt tokens the engine computed, outputs)."""
    computed, step = [], llm._step
    llm._step = lambda: (lambda r: (computed.append(r[1]), r)[1])(step())
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(n for n in computed if n > 0), outs
    finally:
        del llm._step


def samples(llm, args):
    """256 separate prompts (bench.py's workload) against 32 of them with n=8, and those 32 sent 8 times each."""
    rng = Random(args.seed)
    prompts = _random_prompts(rng, args.num_prompts * args.n, args.min_input, args.max_input, args.max_token_id)
    max_tokens = [rng.randint(args.min_output, args.max_output) for _ in prompts]
    k = args.num_prompts
    cases = {
        f"{len(prompts)} prompts, n=1": (prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
                                                    for m in max_tokens]),
        f"{k} prompts, n={args.n}": (prompts[:k], [SamplingParams(n=args.n, temperature=0.6, ignore_eos=True,
                                                                  max_tokens=m) for m in max_tokens[:k]]),
        f"{k} prompts x {args.n} requests": ([p for p in prompts[:k] for _ in range(args.n)],
                                             [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
                                              for m in max_tokens[:k] for _ in range(args.n)]),
    }
    for name, (case_prompts, params) in cases.items():
        llm.scheduler.block_manager.reset_prefix_cache()  # every case starts with an empty prefix cache
        seconds, computed, outs = _timed(llm, case_prompts, params)
        generated = sum(len(o["token_ids"]) for out in outs for o in out["outputs"])
        print(f"samples | {name:28s} | {generated:7d} output tokens in {seconds:6.2f} s = {generated / seconds:8,.0f} "
              f"tok/s | prompt tokens computed {computed:7d}")


def scoring(llm, args):
    """Score whole prompts (max_tokens=1, prompt_logprobs=0), against the same prefill without logprobs."""
    for name, params in (("prompt_logprobs=0", SamplingParams(max_tokens=1, prompt_logprobs=0)),
                         ("prompt_logprobs=5", SamplingParams(max_tokens=1, prompt_logprobs=5)),
                         ("prompt_logprobs=0, flat", SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                    flat_logprobs=True)),
                         ("prompt_logprobs=5, flat", SamplingParams(max_tokens=1, prompt_logprobs=5,
                                                                    flat_logprobs=True)),
                         ("no logprobs (prefill only)", SamplingParams(max_tokens=1))):
        outs = None
        gc.collect()  # (the last case's outputs, collected now: not in this case's time)
        rng = Random(f"{args.seed}-{name}")  # fresh prompts: no prefix-cache hits between cases
        prompts = [[rng.randint(0, args.max_token_id) for _ in range(args.score_len)] for _ in range(args.num_scored)]
        seconds, computed, outs = _timed(llm, prompts, params)
        if params.prompt_logprobs is not None:
            assert all(len(o["prompt_logprobs"]) == args.score_len for o in outs)
        tokens = args.num_scored * args.score_len
        print(f"scoring | {name:28s} | {args.num_scored} prompts x {args.score_len} tokens in {seconds:6.2f} s = "
              f"{tokens / seconds:9,.0f} prompt tok/s | computed {computed}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="*", choices=["samples", "scoring", []], default=[], help="default: both")
    p.add_argument("--model", default=None, help="checkpoint directory (default: Qwen3-0.6B config, random weights)")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts with n samples each")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--num-scored", type=int, default=1000)
    p.add_argument("--score-len", type=int, default=512)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.jobs = args.jobs or ["samples", "scoring"]
    dummy = args.model is None
    llm = LLM(args.model or DEFAULT_CONFIG, load_format="dummy" if dummy else "auto", max_model_len=args.max_model_len)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, n=2, prompt_logprobs=1), use_tqdm=False)  # warm-up
    if "samples" in args.jobs:
        samples(llm, args)
    if "scoring" in args.jobs:
        scoring(llm, args)
    llm.exit()


if __name__ == "__main__":
    main()
