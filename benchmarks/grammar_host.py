"""Structured outputs' host work per step, without a model: advancing every row's matcher by its new token and filling
its bitmask row, as the engine does each step (benchmarks/structured.py's schema, compact JSON, Qwen3-0.6B's
151,936-wide vocabulary over a narrower tokenizer). The tokens are random allowed ones, as random weights produce:
long JSON strings, the costly case.

    python benchmarks/grammar_host.py --tokenizer DIR            # DIR: benchmarks/structured.py --save-tokenizer DIR
    python benchmarks/grammar_host.py --tokenizer DIR --threads 1 2 16

Every setting replays the same tokens on fresh matchers and must give the same bitmasks:
  before             what the engine did before: a grammar as wide as the model's vocabulary (each padded id a
                     special token to xgrammar), xgrammar's threaded batch fill (its default thread count) and its
                     serial batch_accept_token;
  model-wide, N      the same grammar, nanovllm's accept_tokens and fill_bitmasks on N threads;
  tokenizer, N       what the engine does: the tokenizer-wide grammar of nanovllm's GrammarCompiler, N threads.
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
from nanovllm.sampling.structured_outputs import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
    accept_tokens,
    fill_bitmasks,
    grammar_threads,
    require_xgrammar,
)

MODEL_VOCAB = 151_936  # Qwen3-0.6B's


def record_tokens(xgr, compiled, vocab: int, rows: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, a random allowed token for every row (-1 once its matcher has terminated)."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        fill_bitmasks(matchers, bitmask, grammar_threads("cuda"))
        logits = torch.rand(rows, vocab, generator=generator)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        step = [-1 if m.is_terminated() else t for m, t in zip(matchers, logits.argmax(-1).tolist())]
        live = [i for i, t in enumerate(step) if t >= 0]
        assert "error" not in accept_tokens([matchers[i] for i in live], [step[i] for i in live], 1)
        tokens.append(step)
    return tokens


def replay(xgr, compiled, vocab: int, tokens: list[list[int]], threads: int | None):
    """(ms per step advancing, ms per step filling, the last bitmask); threads None: xgrammar's batch API."""
    rows = len(tokens[0])
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32)
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
    stop = [tokenizer.eos_token_id]
    schema = json.dumps(SCHEMA)
    wide = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=stop)
    wide_grammar = xgr.GrammarCompiler(wide).compile_json_schema(schema, any_whitespace=False)
    ours = GrammarCompiler(tokenizer, MODEL_VOCAB, stop)
    grammar = ours.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    tokens = record_tokens(xgr, grammar, ours.vocab_size, args.rows, args.steps, args.seed)
    live = sum(t >= 0 for step in tokens for t in step) / len(tokens)
    print(f"{args.rows} rows, {args.steps} steps ({live:.0f} live rows per step on average), grammar vocabulary "
          f"{MODEL_VOCAB:,} (model) or {ours.vocab_size:,} (tokenizer), {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}")
    threads = args.threads or sorted({1, grammar_threads("cuda")})
    settings = [("before", wide_grammar, MODEL_VOCAB, None)]
    settings += [(f"model-wide, {n}", wide_grammar, MODEL_VOCAB, n) for n in threads]
    settings += [(f"tokenizer, {n}", grammar, ours.vocab_size, n) for n in threads]
    reference = None
    for name, compiled, vocab, n in settings:
        advancing, filling, bitmask = replay(xgr, compiled, vocab, tokens, n)
        words = (ours.vocab_size + 31) // 32  # the tokenizer's ids; past them a model-wide bitmask is all 0
        assert vocab == ours.vocab_size or not bitmask[[t >= 0 for t in tokens[-1]], words:].any()
        reference = bitmask[:, :words] if reference is None else reference
        assert torch.equal(bitmask[:, :words], reference), f"{name}: other bitmasks"
        print(f"{name:>16}: advance {advancing:6.2f} ms/step, fill {filling:6.2f} ms/step, "
              f"together {advancing + filling:6.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
