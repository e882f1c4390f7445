"""Structured outputs: throughput of the same requests with and without a JSON schema (issue 15's record).

    python benchmarks/structured.py --tokenizer DIR     # CUDA: Qwen3-0.6B shape, random weights, 256 requests
    python benchmarks/structured.py                     # no CUDA: the bundled SmolLM2-135M, 16 requests
    python benchmarks/structured.py --save-tokenizer DIR  # write the bundled model's tokenizer (needs gguf) into DIR

The grammar needs a real tokenizer, and the Qwen3-0.6B config has none: with random weights the model is Qwen3-0.6B's
shape (vocabulary 151,936 wide) and the tokenizer is SmolLM2's (49,152 tokens; the ids past it are never allowed),
read from DIR, which --save-tokenizer writes on a machine with the gguf package.

The constrained run goes first; the unconstrained one then generates exactly as many tokens per request (ignore_eos),
so the two differ only by the grammar; each mode runs --repeat times, alternating, and its fastest run counts.
Prompts: random token ids (bench.py's lengths on CUDA) followed by an instruction.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from random import Random

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

QWEN3_CONFIG = os.path.join(HERE, "configs", "qwen3-0.6b", "config.json")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"type": "string", "enum": ["red", "green", "blue"]}, "summary": {"type": "string"}},
          "required": ["name", "age", "color", "summary"], "additionalProperties": False}
INSTRUCTION = " Reply with a JSON record of a person: name, age, favourite color and a summary."
GPU_SIZES = dict(num_seqs=256, max_tokens=256, min_input=100, max_input=1024)
CPU_SIZES = dict(num_seqs=16, max_tokens=64, min_input=16, max_input=64)


def bundled_tokenizer():
    from nanovllm.checkpoint.bundled import default_model_path
    from nanovllm.checkpoint.loader import load_tokenizer
    return load_tokenizer(default_model_path())


def dummy_checkpoint(tokenizer_dir: str | None) -> str:
    """A directory with Qwen3-0.6B's config.json (its EOS made the tokenizer's) and the tokenizer's files."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else bundled_tokenizer()
    path = tempfile.mkdtemp(prefix="nanovllm-structured-")
    with open(QWEN3_CONFIG) as f:
        config = json.load(f)
    config.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer.save_pretrained(path)
    return path


def timed_grammar_work(llm) -> dict:
    """Host seconds spent filling and applying bitmasks and advancing matchers (wrapped, like bench.py's profiler)."""
    seconds = {"bitmask": 0.0, "advance": 0.0}

    def timed(name, fn):
        def wrapper(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                seconds[name] += time.perf_counter() - t
        return wrapper

    grammar = llm.executor.runner.sampler.grammar
    grammar.apply = timed("bitmask", grammar.apply)
    llm._advance_grammars = timed("advance", llm._advance_grammars)
    return seconds


def run(llm, prompts, params) -> tuple[float, list[dict]]:
    llm.scheduler.block_manager.reset_prefix_cache()  # both modes start with an empty prefix cache
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint with a tokenizer (default: see above)")
    p.add_argument("--dummy", action="store_true", help="random weights for --model")
    p.add_argument("--tokenizer", default=None, help="with the default Qwen3-0.6B shape: the tokenizer's directory")
    p.add_argument("--save-tokenizer", default=None, metavar="DIR", help="write the bundled tokenizer there, exit")
    p.add_argument("--num-seqs", type=int, default=None, help="default 256 (CUDA), 16 (CPU)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 256 (CUDA), 64 (CPU)")
    p.add_argument("--min-input", type=int, default=None, help="random prompt ids before the instruction")
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2, help="runs of each mode, alternating; the fastest counts")
    p.add_argument("--mixed", action="store_true",
                   help="also: every other request constrained, against each half alone (what free rows cost)")
    args = p.parse_args()
    if args.save_tokenizer:
        bundled_tokenizer().save_pretrained(args.save_tokenizer)
        print(f"tokenizer written to {args.save_tokenizer}")
        return
    import torch
    cuda = torch.cuda.is_available()
    for name, value in (GPU_SIZES if cuda else CPU_SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    kwargs = dict(enforce_eager=args.enforce_eager, max_model_len=args.max_input + args.max_tokens + 64)
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    scratch = None
    if args.model is None and cuda:
        model = scratch = dummy_checkpoint(args.tokenizer)
        kwargs["load_format"] = "dummy"
        print("Qwen3-0.6B shape, random weights, SmolLM2's tokenizer")
    elif args.model is None:
        from nanovllm.checkpoint.bundled import default_model_path
        model = default_model_path()
        print(f"no CUDA: the bundled SmolLM2-135M, {args.num_seqs} requests (--num-seqs and --model change it)")
    else:
        model = args.model
        if args.dummy:
            kwargs["load_format"] = "dummy"
    try:
        llm = LLM(model, **kwargs)
        rng = Random(args.seed)
        instruction = llm.tokenizer.encode(INSTRUCTION, add_special_tokens=False)
        prompts = [[rng.randrange(len(llm.tokenizer)) for _ in range(rng.randint(args.min_input, args.max_input))]
                   + instruction for _ in range(args.num_seqs)]
        # compact JSON: given free whitespace, random weights write nothing but blanks (one grammar state)
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        constrained = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                     structured_outputs=spec)
        llm.generate(prompts[:2], [constrained, SamplingParams(max_tokens=8)], use_tqdm=False)  # warm-up, compile
        grammar_seconds = timed_grammar_work(llm)
        seconds, outs = run(llm, prompts, constrained)
        lengths = [len(o["token_ids"]) for o in outs]
        complete = sum(o["finish_reason"] == "stop" for o in outs)
        for o in outs:  # what finished must parse (a truncated answer finishes with "length")
            if o["finish_reason"] == "stop":
                json.loads(o["text"])
        free = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in lengths]
        best = {"constrained": seconds, "unconstrained": run(llm, prompts, free)[0]}
        for _ in range(args.repeat - 1):  # alternating, the fastest of each: a shared machine's noise hits both
            best["constrained"] = min(best["constrained"], run(llm, prompts, constrained)[0])
            best["unconstrained"] = min(best["unconstrained"], run(llm, prompts, free)[0])
        total = sum(lengths)
        print(f"constrained:   {args.num_seqs} requests, {total} output tokens in {best['constrained']:.2f}s: "
              f"{total / best['constrained']:,.0f} tok/s (mean {total / len(lengths):.0f} tokens, {complete} complete "
              f"JSON, {args.num_seqs - complete} cut by max_tokens; host time per run in bitmasks "
              f"{grammar_seconds['bitmask'] / args.repeat:.2f}s, advancing matchers "
              f"{grammar_seconds['advance'] / args.repeat:.2f}s)")
        print(f"unconstrained: {args.num_seqs} requests, {total} output tokens in {best['unconstrained']:.2f}s: "
              f"{total / best['unconstrained']:,.0f} tok/s (the same lengths, ignore_eos)")
        print(f"constrained / unconstrained = {best['unconstrained'] / best['constrained']:.2f} (async_scheduling="
              f"{llm.config.async_scheduling}, device {llm.config.device}, best of {args.repeat})")
        if args.mixed:  # the grammar's host work must not grow with the free rows of a batch
            mixed = [constrained if i % 2 == 0 else free[i] for i in range(len(prompts))]
            halves = {"mixed": (prompts, mixed), "constrained half": (prompts[::2], constrained),
                      "free half": (prompts[1::2], free[1::2])}
            for name, (ps, sps) in halves.items():
                for key in grammar_seconds:
                    grammar_seconds[key] = 0.0
                wall = min(run(llm, ps, sps)[0] for _ in range(args.repeat))
                bitmask, advance = (grammar_seconds[k] / args.repeat for k in ("bitmask", "advance"))
                print(f"{name:17s} {len(ps)} requests: {wall:.2f}s; host time per run in bitmasks {bitmask:.3f}s, "
                      f"advancing {advance:.3f}s")
        llm.exit()
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
