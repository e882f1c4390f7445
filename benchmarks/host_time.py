"""Where the host's time goes in a decode step of the real loop (async scheduling on), and how long it waits for
the GPU: a wait near zero means the loop is host-bound (the CPU, not the GPU, sets ms/token).

    python benchmarks/host_time.py [--batches 16 1] [--model PATH] [--new-tokens 128] [--prompt-len 512]
                                    [--max-token-id 10000] [--logprobs K]

The prompts are prefilled first; then the counters start and `--new-tokens` decode steps run through
`llm.step()`, each part timed by wrapping the engine's methods (a few us of overhead each). Parts nest (launch
holds runner.prepare, which holds graphs.stage (a step a graph runs: its inputs in one copy), run_model, the
sampler; run_model holds graphs.replay, which holds graph.replay, and compute_logits, which the graphs of up to 16
rows run inside). No torch profiler: under CUPTI a
graph launch took 274 us of host time against 14-19 us without (docs/benchmarks.md), which makes the loop look
host-bound when it is not.
"""
import argparse
import collections
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-0.6b")
total: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(obj, name: str, label: str):
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(obj, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 1])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--logprobs", type=int, default=None, help="ask every request for K top logprobs")
    args = p.parse_args()
    dummy = {"load_format": "dummy"} if args.model == DEFAULT_CONFIG else {}
    llm = LLM(args.model, enable_prefix_caching=False, **dummy)
    runner = llm.executor.runner  # one process (no tensor parallelism)
    settle = runner.settle

    def waiting_settle(step):
        t = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        total["wait for the GPU (in settle)"] += time.perf_counter() - t
        return settle(step)
    runner.settle = waiting_settle
    parts = [(llm, "step", "engine step"), (llm.scheduler, "schedule", "schedule"),
             (runner, "launch", "launch"), (runner, "prepare", "runner.prepare"),
             (runner.sampler, "prepare", "sampler.prepare"), (runner, "run_model", "run_model"),
             (runner.model, "compute_logits", "compute_logits"), (runner, "_to_host", "copy tokens to host"),
             (llm, "_apply", "apply tokens"), (runner.sampler, "forward", "sampler.forward"),
             (runner, "_logprob_dicts", "logprob dicts")]
    if runner.graphs is not None:
        parts += [(runner.graphs, "replay", "graphs.replay"), (runner.graphs, "stage", "graphs.stage")]
        for graph in runner.graphs.graphs.values():
            timed(graph, "replay", "graph.replay")
    for obj, name, label in parts:
        timed(obj, name, label)
    rng = random.Random(0)

    def prompts(batch):
        return [[rng.randint(0, args.max_token_id) for _ in range(args.prompt_len)] for _ in range(batch)]

    def params(n):
        return SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, logprobs=args.logprobs)
    for batch in args.batches:
        llm.generate(prompts(batch), params(32), use_tqdm=False)  # warm-up
        for prompt in prompts(batch):
            llm.add_request(prompt, params(args.new_tokens + 8))
        sched = llm.scheduler
        while sched.waiting or any(seq.num_cached_tokens < seq.num_prompt_tokens for seq in sched.running):
            llm.step()  # the prefills
        llm.step()  # the first decode step: from here on one step is launched while the previous settles
        total.clear()
        calls.clear()
        t = time.perf_counter()
        for _ in range(args.new_tokens):
            llm.step()
        wall = time.perf_counter() - t
        steps, timed_parts = calls["launch"], dict(total)
        while not llm.is_finished():
            llm.step()
        wait = timed_parts["wait for the GPU (in settle)"]
        print(f"batch {batch}: {wall / steps * 1e3:.3f} ms/step; per step: host busy "
              f"{(timed_parts['engine step'] - wait) / steps * 1e6:.0f} us, waiting for the GPU "
              f"{wait / steps * 1e6:.0f} us ({steps} decode steps)")
        for label, seconds in sorted(timed_parts.items(), key=lambda kv: -kv[1]):
            print(f"  {label:30s} {seconds / steps * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
