"""Where the first seconds of `LLM(...)` go before the engine starts: imports and transformers' config and tokenizer
loading, each timed on its own (run it first on a fresh machine: cold file caches are the case that matters).

    python benchmarks/startup_probe.py [--model DIR] [--tokenizer DIR]
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(HERE, "benchmarks", "configs", "qwen3-0.6b"))
    p.add_argument("--tokenizer", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    last = t0

    def mark(what: str):
        nonlocal last
        now = time.perf_counter()
        print(f"{what:40s} {now - last:7.3f} s  (total {now - t0:7.3f})", flush=True)
        last = now

    import torch
    mark("import torch")
    torch.cuda.is_available()
    mark("torch.cuda.is_available()")
    import triton  # noqa: F401
    mark("import triton")
    import transformers  # noqa: F401
    mark("import transformers")
    from transformers import AutoConfig, AutoTokenizer
    mark("from transformers import AutoConfig, AutoTokenizer")
    AutoConfig.from_pretrained(args.model)
    mark("AutoConfig.from_pretrained")
    AutoConfig.from_pretrained(args.model)
    mark("AutoConfig.from_pretrained (again)")
    try:
        AutoTokenizer.from_pretrained(args.model)
        mark("AutoTokenizer (model dir)")
    except (OSError, ValueError) as e:
        mark(f"AutoTokenizer (model dir) failed: {type(e).__name__}")
    if args.tokenizer:
        AutoTokenizer.from_pretrained(args.tokenizer)
        mark("AutoTokenizer (tokenizer dir)")
    sys.path.insert(0, HERE)
    import nanovllm  # noqa: F401
    mark("import nanovllm")
    from nanovllm.config import Config
    Config.from_kwargs(args.model, load_format="dummy")
    mark("nanovllm Config.from_kwargs")


if __name__ == "__main__":
    main()
