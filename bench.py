"""Offline throughput on the nano-vllm workload.

    python bench.py                       # Qwen3-0.6B architecture, random weights (load_format="dummy")
    python bench.py --model PATH          # a real checkpoint
    python bench.py --engine hf           # also run HF transformers' continuous batching; print both and the ratio
    python bench.py --kv-cache-dtype fp8  # an 8-bit KV cache
    python bench.py --dp 2                # two engine replicas (data parallel), each on its own GPU
    python bench.py --lora 4              # 4 random rank-16 LoRA adapters, the requests spread over them
    python bench.py --enable-lora         # LoRA enabled, no request uses an adapter
    python bench.py --quantization fp8    # fp8 weights (quantized at load)
"""
import argparse
import json
import os
import tempfile
import time
from random import randint, seed

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "benchmarks", "configs", "qwen3-0.6b")


GPU_WORKLOAD = dict(num_seqs=256, min_input=100, max_input=1024, min_output=100, max_output=1024)  # nano-vllm's
CPU_WORKLOAD = dict(num_seqs=32, min_input=32, max_input=256, min_output=64, max_output=128)


def workload(args) -> tuple[list[list[int]], list[int]]:
    """seed 0; prompts of random ids in [0, max_token_id], lengths and max_tokens uniform in the given ranges."""
    seed(args.seed)
    prompts = [[randint(0, args.max_token_id) for _ in range(randint(args.min_input, args.max_input))]
               for _ in range(args.num_seqs)]
    max_tokens = [randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def random_adapters(model: str, n: int, rank: int, directory: str) -> list:
    """`n` PEFT-format LoRA adapters of rank `rank` on every attention and MLP projection of `model` (a directory
    with config.json), random weights of a modest scale, written under `directory`: LoRARequests 1..n."""
    import torch
    from safetensors.torch import save_file

    from nanovllm import LoRARequest
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(1, n + 1):
        path = os.path.join(directory, f"adapter{i}")
        os.makedirs(path)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (out, inp) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                       "target_modules": [m.split(".")[1] for m in shapes]}, f)
        requests.append(LoRARequest(f"adapter{i}", i, path))
    return requests


def startup_phases(llm) -> str:
    """The engine's start-up phases and Triton compile tally (rank 0's runner; not with --dp)."""
    runner = getattr(getattr(llm, "executor", None), "runner", None)
    phases = {**getattr(llm, "startup", {}), **(runner.startup if runner is not None else {})}
    compiles = getattr(runner, "compiles", None)
    return ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()) + (f"; {compiles}" if compiles else "")


def run_nanovllm(args, prompts, max_tokens) -> float:
    from nanovllm import LLM, SamplingParams
    kwargs = dict(enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                  tensor_parallel_size=args.tp, load_format="dummy" if args.dummy else "auto")
    if args.dp > 1:
        if args.profile:
            raise SystemExit("--profile times one engine's steps: run it without --dp")
        kwargs["data_parallel_size"] = args.dp
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        kwargs["quantization"] = args.quantization
    loras = None
    if args.lora or args.enable_lora:
        kwargs.update(enable_lora=True, max_loras=max(args.lora, 1), max_lora_rank=args.lora_rank)
    if args.lora:  # request i uses adapter i % N
        adapters = random_adapters(args.model, args.lora, args.lora_rank, tempfile.mkdtemp(prefix="bench-lora-"))
        loras = [adapters[i % args.lora] for i in range(len(prompts))]
        print(f"{args.lora} LoRA adapters of rank {args.lora_rank}, requests spread over them")
    t = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    print(f"engine start: {time.perf_counter() - t:.1f}s ({startup_phases(llm)}), {llm.num_kvcache_blocks} KV blocks")
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False,  # warm-up
                 lora_request=loras[:1] if loras else None)
    probe = StepProfiler(llm) if args.profile else None
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm, lora_request=loras)
    elapsed = time.perf_counter() - t
    if probe:
        probe.report()
    total = sum(len(o["token_ids"]) for o in outs)
    for s in getattr(llm, "last_stats", []):  # data parallel: each replica's share
        print(f"replica {s['replica']}: {s['requests']} requests, {s['output_tokens']} output tokens in "
              f"{s['seconds']:.2f}s: {s['output_tokens'] / s['seconds']:,.0f} tok/s")
    if hasattr(llm, "exit"):
        llm.exit()
    print(f"nanovllm: {total} output tokens in {elapsed:.2f}s: {total / elapsed:,.0f} tok/s")
    return total / elapsed


class StepProfiler:
    """Where a step's time goes: wall time per step, the model forward and the sampler on the GPU (CUDA events);
    the remainder is host time (scheduling, tensor preparation, postprocessing) not hidden behind the GPU."""

    def __init__(self, llm):
        import torch
        self.torch, self.steps = torch, {True: [], False: []}
        runner, engine_step = llm.executor.runner, llm._step  # (what generate() calls each step)
        run_model, sampler = runner.run_model, runner.sampler
        self.events = []

        def timed(fn):
            def wrapper(*args, **kwargs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.events.append((start, end))
                return out
            return wrapper

        def timed_step():
            self.events = []
            t = time.perf_counter()
            result = engine_step()
            is_prefill = result[1] > 0
            self.steps[is_prefill].append((time.perf_counter() - t, list(self.events)))
            return result

        runner.run_model, sampler.forward, llm._step = timed(run_model), timed(sampler.forward), timed_step

    def report(self):
        self.torch.cuda.synchronize()
        for is_prefill, rows in self.steps.items():
            if not rows:
                continue
            n = len(rows)
            wall = sum(r[0] for r in rows) * 1e3
            # under async scheduling a step may only settle the step before it and launch nothing
            model = sum(r[1][0][0].elapsed_time(r[1][0][1]) for r in rows if r[1])
            sample = sum(r[1][1][0].elapsed_time(r[1][1][1]) for r in rows if len(r[1]) > 1)
            print(f"{'prefill' if is_prefill else 'decode '} steps: {n:5d}, wall {wall / n:7.2f} ms/step = model "
                  f"forward {model / n:7.2f} + sampler {sample / n:5.2f} + host {(wall - model - sample) / n:5.2f} "
                  f"ms/step; total {wall / 1e3:6.2f} s")
            if is_prefill:
                print("  prefill steps (wall ms):", " ".join(f"{r[0] * 1e3:.0f}" for r in rows))


def run_hf(args, prompts, max_tokens) -> float:
    """HF transformers' continuous batching (ContinuousBatchingManager, paged attention)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.dummy:
        config = AutoConfig.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:  # (a .gguf file is read from nanovllm's converted copy)
        from nanovllm.checkpoint.loader import resolve_checkpoint
        model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(args.model), dtype=dtype,
                                                     attn_implementation="sdpa")
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, temperature=args.temperature,
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    t = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
    total, done = 0, 0
    while done < len(prompts):
        result = manager.get_result(timeout=60)
        if result is None:
            break
        total += len(result.generated_tokens)
        done += 1
    elapsed = time.perf_counter() - t
    manager.stop(block=True)
    print(f"hf: {total} output tokens in {elapsed:.2f}s: {total / elapsed:,.0f} tok/s ({done} requests)")
    return total / elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: with CUDA the "
                   "Qwen3-0.6B architecture with random weights; without, the bundled SmolLM2-135M)")
    p.add_argument("--engine", choices=["nanovllm", "hf"], default="nanovllm",
                   help="hf: run nanovllm and then HF continuous batching on the same workload")
    p.add_argument("--num-seqs", type=int, default=None, help="default 256 (CUDA), 32 (CPU)")
    p.add_argument("--min-input", type=int, default=None, help="default 100 (CUDA), 32 (CPU)")
    p.add_argument("--max-input", type=int, default=None, help="default 1024 (CUDA), 256 (CPU)")
    p.add_argument("--min-output", type=int, default=None, help="default 100 (CUDA), 64 (CPU)")
    p.add_argument("--max-output", type=int, default=None, help="default 1024 (CUDA), 128 (CPU)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids are uniform in [0, this]")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: the engine default")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--dp", type=int, default=1, help="data_parallel_size: engine replicas, each on --tp GPUs")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch decode step N+1 before reading step N's tokens (default: on for one CUDA rank)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8, fp8_e4m3 or fp8_e5m2")
    p.add_argument("--quantization", default=None, help="fp8: the linear layers' weights in fp8 (quantized at load)")
    p.add_argument("--lora", type=int, default=0, help="N random LoRA adapters (max_loras=N), request i uses "
                   "adapter i %% N (needs a model directory with config.json)")
    p.add_argument("--lora-rank", type=int, default=16, help="the --lora adapters' rank (max_lora_rank)")
    p.add_argument("--enable-lora", action="store_true", help="enable_lora=True with no adapter requests")
    p.add_argument("--dummy", action="store_true", help="random weights (implied when --model is not given)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--profile", action="store_true", help="print wall vs GPU time per prefill/decode step")
    args = p.parse_args()
    import torch
    sizes = GPU_WORKLOAD if torch.cuda.is_available() else CPU_WORKLOAD
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model is None and not torch.cuda.is_available():
        from nanovllm.checkpoint.bundled import default_model_path
        args.model = default_model_path()
        print(f"no CUDA: the bundled SmolLM2-135M and a CPU-sized workload ({args.num_seqs} sequences; the GPU "
              "workload would take hours here); --model and the size options change it")
    if args.model is None:
        args.model, args.dummy = DEFAULT_CONFIG, True
    prompts, max_tokens = workload(args)
    print(f"{len(prompts)} sequences, {sum(map(len, prompts))} prompt tokens, {sum(max_tokens)} output tokens")
    ours = run_nanovllm(args, prompts, max_tokens)
    if args.engine == "hf":
        theirs = run_hf(args, prompts, max_tokens)
        print(f"nanovllm / hf = {ours / theirs:.1f}x")


if __name__ == "__main__":
    main()
