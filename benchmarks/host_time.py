"""Where the host's time goes in a decode step of the real generate loop (async scheduling on), and how long it
waits for the GPU: a wait near zero means the loop is host-bound (the CPU, not the GPU, sets ms/token).

    python benchmarks/host_time.py [--batches 16 1] [--model PATH] [--new-tokens 128] [--prompt-len 512]
                                    [--max-token-id 10000]

Each part is timed by wrapping the engine's methods (a few us of overhead each); parts nest (launch holds
runner.prepare, run_model, the sampler; run_model holds graphs.replay, which holds fill_graph_buffers and
graph.replay, and compute_logits, which the graphs of up to 16 rows run inside). No torch profiler: under CUPTI a graph launch took 274 us of host time against
14-19 us without (docs/benchmarks.md), which makes the loop look host-bound when it is not.
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
             (llm, "_apply", "apply tokens")]
    if runner.graphs is not None:
        parts += [(runner.graphs, "replay", "graphs.replay"), (runner.backend, "fill_graph_buffers",
                                                                "fill_graph_buffers")]
        for graph in runner.graphs.graphs.values():
            timed(graph, "replay", "graph.replay")
    for obj, name, label in parts:
        timed(obj, name, label)
    rng = random.Random(0)

    def prompts(batch):
        return [[rng.randint(0, args.max_token_id) for _ in range(args.prompt_len)] for _ in range(batch)]

    def params(n):
        return SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)
    for batch in args.batches:
        llm.generate(prompts(batch), params(32), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        llm.generate(prompts(batch), params(1), use_tqdm=False)
        first = time.perf_counter() - t
        total.clear()
        calls.clear()
        t = time.perf_counter()
        llm.generate(prompts(batch), params(1 + args.new_tokens), use_tqdm=False)
        full = time.perf_counter() - t
        steps = calls["launch"]
        wait = total["wait for the GPU (in settle)"]
        print(f"batch {batch}: {(full - first) / args.new_tokens * 1e3:.3f} ms/token; per step: host busy "
              f"{(total['engine step'] - wait) / steps * 1e6:.0f} us, waiting for the GPU {wait / steps * 1e6:.0f} us "
              f"({steps} steps)")
        for label, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"  {label:30s} {seconds / steps * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
