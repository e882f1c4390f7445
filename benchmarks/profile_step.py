"""Where one engine step's GPU time goes, kernel by kernel (torch.profiler; kernels inside CUDA graphs included).

    python benchmarks/profile_step.py --cases decode:256:100-1024 decode:1:512 prefill:8:2048 [--kv-cache-dtype fp8]
        [--quantization fp8]

decode:B:LO-HI: B prompts of random token ids, lengths uniform in LO-HI, are prefilled, `--warm` decode steps run,
then `--steps` decode steps are profiled. prefill:B:LEN: the prefill steps of B prompts of LEN tokens (max_tokens 1).
One engine serves all cases. With --tp the profiler sees rank 0's GPU (its NCCL all-reduce kernels included).
Prints wall ms per step (without the profiler), kernels per step, GPU busy per step, and the kernels by time.
With --critical, a decode case also prints what each kernel adds to the step's finish line: kernels in start order,
each charged the time by which its end moves the latest end so far (under programmatic dependent launch a kernel
starts while the one before runs, so its own duration overstates it) and the idle time before its start. Linear
kernels are labelled with the two kernels before them: at batch 16 o_proj follows decode attention and down follows
SiLU, while qkv, gate_up and the LM head share "after an RMSNorm after a linear kernel".
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-0.6b")


def device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return getattr(evt, name)
    return 0.0


def report(prof, steps: int, top: int):
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and device_us(e) > 0]
    busy = sum(device_us(e) for e in kernels) / steps
    count = sum(e.count for e in kernels) / steps
    print(f"GPU busy {busy / 1e3:.3f} ms/step, {count:.0f} kernels/step")
    print(f"{'kernel':70s} {'calls/step':>10s} {'us/call':>8s} {'us/step':>9s} {'share':>6s}")
    for e in sorted(kernels, key=device_us, reverse=True)[:top]:
        total = device_us(e) / steps
        print(f"{e.key[:70]:70s} {e.count / steps:10.1f} {device_us(e) / e.count:8.1f} {total:9.1f} "
              f"{100 * total / busy:5.1f}%")


def short(name: str) -> str:
    return name.strip("_").split("(")[0][:22]


def critical_path(prof, steps: int, top: int):
    """Finish-line attribution (see the module's docstring), us a step, by kernel (linear kernels by context)."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    adds, idle, calls, names = {}, {}, {}, []
    latest = None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        name = label = short(e.name)
        if "gemv" in name:
            label += "".join(f" after {before}" for before in reversed(names[-2:]))
        names.append(name)
        latest = start if latest is None else latest
        idle[label] = idle.get(label, 0.0) + max(0.0, start - latest)
        adds[label] = adds.get(label, 0.0) + max(0.0, end - max(latest, start))
        calls[label] = calls.get(label, 0) + 1
        latest = max(latest, end)
    span = (sum(adds.values()) + sum(idle.values())) / steps
    print(f"finish line: {span / 1e3:.3f} ms/step = {sum(adds.values()) / steps / 1e3:.3f} kernels + "
          f"{sum(idle.values()) / steps / 1e3:.3f} idle")
    print(f"{'kernel (linear: after the two kernels before it)':78s} {'calls/step':>10s} {'adds us':>8s} "
          f"{'idle us':>8s}")
    for label in sorted(adds, key=lambda k: adds[k] + idle[k], reverse=True)[:top]:
        print(f"{label[:78]:78s} {calls[label] / steps:10.1f} {adds[label] / steps:8.1f} {idle[label] / steps:8.1f}")


def run_case(llm, case: str, warm: int, steps: int, top: int, critical: bool = False):
    """case: decode:BATCH:LO-HI or prefill:BATCH:LEN (prompt lengths uniform in LO-HI)."""
    kind, batch, lens = case.split(":")
    lo, _, hi = lens.partition("-")
    lo, hi, batch = int(lo), int(hi or lo), int(batch)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]
    print(f"\n== {case}: {batch} prompts of {lo}-{hi} tokens")
    if kind == "prefill":
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # once without the profiler, for the wall time
        wall = time.perf_counter() - t
        for prompt in prompts:  # other tokens, so no prefix-cache hit on the first run's blocks
            llm.add_request([(t + 1) % 10000 for t in prompt], params)
        n = 0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while not llm.is_finished():
                llm.step()
                n += 1
            torch.cuda.synchronize()
        print(f"prefill: {n} steps, {sum(map(len, prompts)) / wall:,.0f} prompt tok/s wall (without the profiler)")
        report(prof, n, top)
        return
    params = SamplingParams(max_tokens=warm + 2 * steps + 8, ignore_eos=True, temperature=0.6)
    for prompt in prompts:
        llm.add_request(prompt, params)
    while llm.scheduler.waiting or any(seq.num_cached_tokens < seq.num_prompt_tokens for seq in llm.scheduler.running):
        llm.step()
    for _ in range(warm):
        llm.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    while not llm.is_finished():
        llm.step()
    print(f"decode: batch {batch}, wall {wall * 1e3:.3f} ms/step ({batch / wall:,.0f} tok/s) without the profiler")
    report(prof, steps, top)
    if critical:
        critical_path(prof, steps, top)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG)
    p.add_argument("--cases", nargs="+", default=["decode:256:100-1024"])
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default=None, help="fp8: the weights in fp8 (quantized at load)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (rank 0's GPU is profiled)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--critical", action="store_true", help="decode cases: what each kernel adds to the finish line")
    args = p.parse_args()
    t = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp, async_scheduling=args.async_scheduling,
              quantization=args.quantization)
    print(f"engine start {time.perf_counter() - t:.1f}s, kv_cache_dtype={args.kv_cache_dtype}, tp={args.tp}, "
          f"quantization={args.quantization}")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    for case in args.cases:
        run_case(llm, case, args.warm, args.steps, args.top, args.critical)
    llm.exit()


if __name__ == "__main__":
    main()
