"""Structured outputs' host work per step, without a model: advancing every row's matcher by its new token and filling
its bitmask row, as the engine does each step (benchmarks/structured.py's schema, compact JSON, a 151,936-wide
vocabulary). The tokens are random allowed ones, as random weights produce: long JSON strings, the costly case.

    python benchmarks/grammar_host.py --tokenizer DIR            # DIR: benchmarks/structured.py --save-tokenizer DIR
    python benchmarks/grammar_host.py --tokenizer DIR --threads 1 2 16

Each setting replays the same tokens on fresh matchers and must give the same bitmasks. "xgrammar" is xgrammar's own
batch API (BatchGrammarMatcher's threaded fill, its default thread count, and the serial batch_accept_token);
"threads=N" is nanovllm's accept_tokens and fill_bitmasks on N threads.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from benchmarks.structured import SCHEMA  # noqa: E402
from nanovllm.structured_outputs import accept_tokens, fill_bitmasks, grammar_threads, require_xgrammar  # noqa: E402

VOCAB = 151_936  # Qwen3-0.6B's


def record_tokens(xgr, compiled, rows: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, a random allowed token for every row (-1 once its matcher has terminated)."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = torch.empty(rows, (VOCAB + 31) // 32, dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        fill_bitmasks(matchers, bitmask, grammar_threads("cuda"))
        logits = torch.rand(rows, VOCAB, generator=generator)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        step = [-1 if m.is_terminated() else t for m, t in zip(matchers, logits.argmax(-1).tolist())]
        live = [i for i, t in enumerate(step) if t >= 0]
        assert "error" not in accept_tokens([matchers[i] for i in live], [step[i] for i in live], 1)
        tokens.append(step)
    return tokens


def replay(xgr, compiled, tokens: list[list[int]], threads: int | None) -> tuple[float, float, torch.Tensor]:
    """(ms per step advancing, ms per step filling, the last bitmask); threads None: xgrammar's batch API."""
    rows = len(tokens[0])
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = torch.empty(rows, (VOCAB + 31) // 32, dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher()
    advancing = filling = 0.0
    for previous in [None] + tokens[:-1]:
        start = time.perf_counter()
        if previous is not None:
            live = [i for i, t in enumerate(previous) if t >= 0]
            if threads is None:
                xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], [previous[i] for i in live])
            else:
                accept_tokens([matchers[i] for i in live], [previous[i] for i in live], threads)
        mid = time.perf_counter()
        if threads is None:
            live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
            batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)
            bitmask[[i for i, m in enumerate(matchers) if m.is_terminated()]] = -1  # as fill_bitmasks does
        else:
            fill_bitmasks(matchers, bitmask, threads)
        advancing, filling = advancing + mid - start, filling + time.perf_counter() - mid
    n = len(tokens)
    return advancing / (n - 1) * 1e3, filling / n * 1e3, bitmask


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (benchmarks/structured.py writes one)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help=f"default: 1 and what the engine uses with a GPU ({grammar_threads('cuda')} here)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoTokenizer
    xgr = require_xgrammar()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    tokens = record_tokens(xgr, compiled, args.rows, args.steps, args.seed)
    live = sum(t >= 0 for step in tokens for t in step) / len(tokens)
    print(f"{args.rows} rows, {args.steps} steps ({live:.0f} live rows per step on average), {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}")
    reference = None
    for threads in [None] + (args.threads or sorted({1, grammar_threads('cuda')})):
        advancing, filling, bitmask = replay(xgr, compiled, tokens, threads)
        if reference is None:
            reference = bitmask
        assert torch.equal(bitmask, reference), "a setting filled other bitmasks"
        name = "xgrammar" if threads is None else f"threads={threads}"
        print(f"{name:>12}: advance {advancing:6.2f} ms/step, fill {filling:6.2f} ms/step, "
              f"together {advancing + filling:6.2f} ms/step")


if __name__ == "__main__":
    main()
