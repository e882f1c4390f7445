"""Throughput with and without per-request sampling options (same workload, same engine).

    python benchmarks/sampling.py [--model PATH] [--num-seqs 256] [--input-len 256] [--output-len 256]
                                  [--only plain logprobs ...]
"""
import argparse
import os
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402

VARIANTS = {
    "plain (temperature 0.6)": dict(temperature=0.6),
    "greedy": dict(temperature=0),
    "top_k=20 top_p=0.95": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top_k/top_p/min_p": dict(temperature=0.6, top_k=50, top_p=0.9, min_p=0.05),
    "penalties (rep 1.1, pres 0.5, freq 0.5)": dict(temperature=0.6, repetition_penalty=1.1, presence_penalty=0.5,
                                                    frequency_penalty=0.5),
    "seeded": dict(temperature=0.6, seed=1),
    "seeded top_k=20 top_p=0.95": dict(temperature=0.6, top_k=20, top_p=0.95, seed=1),
    "logprobs=5": dict(temperature=0.6, logprobs=5),
    "logprobs=0 (the sampled token's)": dict(temperature=0.6, logprobs=0),
    "plain again (order check)": dict(temperature=0.6),
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(here, "configs", "qwen3-0.6b"))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--dummy", action="store_true", help="random weights (implied for the bundled configs)")
    p.add_argument("--only", nargs="+", default=None, help="the variants whose names contain one of these")
    args = p.parse_args()
    variants = {name: opts for name, opts in VARIANTS.items() if not args.only or any(w in name for w in args.only)}
    dummy = args.dummy or not os.path.exists(os.path.join(args.model, "model.safetensors"))
    # no prefix caching: every variant prefills the same prompts from scratch
    llm = LLM(args.model, load_format="dummy" if dummy else "auto", max_model_len=args.input_len + args.output_len + 8,
              enable_prefix_caching=False)
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(args.input_len)] for _ in range(args.num_seqs)]
    for opts in variants.values():  # (a variant's first use may compile its kernels: not timed)
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, **opts), use_tqdm=False)
    rows = []
    for name, opts in variants.items():
        sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **opts)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        rows.append((name, sum(len(o["token_ids"]) for o in outs) / dt))
    base = rows[0][1]
    print(f"\n{args.num_seqs} seqs x {args.input_len} prompt + {args.output_len} output tokens, {args.model}")
    print(f"{'sampling options':42s} {'tok/s':>10s} {'vs plain':>9s}")
    for name, tput in rows:
        print(f"{name:42s} {tput:10,.0f} {tput / base:8.2f}x")


if __name__ == "__main__":
    main()
