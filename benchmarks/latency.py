"""Small-batch latency and prefill throughput (issue #14's rows), Qwen3-0.6B shape with random weights.

    python benchmarks/latency.py [--model PATH] [--prefill-seqs 512] [--batches 1 16 64] [--prompt-len 512]
                                 [--lora-rank R] [--quantization fp8]

- decode ms/token at batch 1, 16 and 64: prompts of 512 random tokens (--prompt-len: the decode rows' contexts
  start there); (time for 1 + N tokens - time for 1 token) / N, so prefill is left out; median of three runs.
- time to first token for one 512-token prompt (max_tokens 1), median of five.
- prefill-heavy: `--prefill-seqs` prompts x 2048 random tokens, max_tokens 1: prompt tokens per second.
--lora-rank R: every request under one random LoRA adapter of rank R (bench.py's random_adapters).
Prefix caching is off, so every run computes its prompts. Each row starts after `--clocks-up` seconds of matmuls
(default 3), so a GPU fresh from idle clocks does not decide it.
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import random_adapters, startup_phases  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-0.6b")
RNG = random.Random(0)
MAX_TOKEN_ID = 10000  # --max-token-id


def prompts(n: int, length: int) -> list[list[int]]:
    return [[RNG.randint(0, MAX_TOKEN_ID) for _ in range(length)] for _ in range(n)]


def clocks_up(seconds: float):
    """Bring the GPU's clocks up before a timed row: an idle H200 sits at 345 MHz and a batch-1 decode, too light
    to raise them at once, read 0.90-1.15 ms/token on a GPU fresh from idle against 0.86 after 8 s of matmuls
    (docs/benchmarks.md). The rows measure the steady state."""
    import torch
    if seconds <= 0 or not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


LORA = None  # --lora-rank: the adapter every request uses


def timed(llm, batch: list[list[int]], max_tokens: int) -> float:
    t = time.perf_counter()
    llm.generate(batch, SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False,
                 lora_request=LORA)
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prefill-seqs", type=int, default=512, help="0: no prefill row")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dummy", action="store_true", help="random weights (implied for the default model)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the decode rows")
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids are uniform in [0, this]")
    p.add_argument("--quantization", default=None, help="fp8: the weights in fp8 (quantized at load)")
    p.add_argument("--lora-rank", type=int, default=0, help="every request under one random adapter of this rank")
    p.add_argument("--clocks-up", type=float, default=3.0, help="seconds of matmuls before each timed row (0: none)")
    args = p.parse_args()
    if args.new_tokens < 1 or args.prefill_seqs < 0 or min(args.batches) < 1 or args.prompt_len < 1:
        p.error("--new-tokens, --prompt-len and every --batches value must be at least 1, --prefill-seqs at least 0")
    options = {"load_format": "dummy"} if args.model == DEFAULT_CONFIG or args.dummy else {}
    if args.quantization:
        options["quantization"] = args.quantization
    global LORA, MAX_TOKEN_ID
    MAX_TOKEN_ID = args.max_token_id
    if args.lora_rank:
        LORA = random_adapters(args.model, 1, args.lora_rank, tempfile.mkdtemp(prefix="latency-lora-"))[0]
        options.update(enable_lora=True, max_lora_rank=args.lora_rank)
    t = time.perf_counter()
    llm = LLM(args.model, enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype, **options)
    print(f"engine start {time.perf_counter() - t:.1f}s ({startup_phases(llm)})")
    timed(llm, prompts(2, 512), 4)  # warm-up
    rows = []
    for batch in args.batches:
        per_token = []
        clocks_up(args.clocks_up)
        for _ in range(3):
            first = timed(llm, prompts(batch, args.prompt_len), 1)
            full = timed(llm, prompts(batch, args.prompt_len), 1 + args.new_tokens)
            per_token.append((full - first) / args.new_tokens)
        ms = statistics.median(per_token) * 1e3
        runs = ", ".join(f"{t * 1e3:.3f}" for t in per_token)
        runs += "" if args.prompt_len == 512 else f"; {args.prompt_len}-token prompts"
        rows.append(f"decode batch {batch:3d}: {ms:6.3f} ms/token ({batch / ms * 1e3:,.0f} tok/s; runs {runs})")
        print(rows[-1], flush=True)
    clocks_up(args.clocks_up)
    ttft = statistics.median(timed(llm, prompts(1, 512), 1) for _ in range(5)) * 1e3
    rows.append(f"time to first token, 512-token prompt: {ttft:.2f} ms")
    print(rows[-1], flush=True)
    if args.prefill_seqs > 0:
        batch = prompts(args.prefill_seqs, 2048)
        clocks_up(args.clocks_up)
        seconds = timed(llm, batch, 1)
        rows.append(f"prefill {args.prefill_seqs} x 2048 tokens, max_tokens 1: {seconds:.2f} s, "
                    f"{args.prefill_seqs * 2048 / seconds:,.0f} prompt tok/s")
        print(rows[-1], flush=True)
    llm.exit()
    print("\n== latency ==\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
