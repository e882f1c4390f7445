"""The sampler's race kernel (kernels/race.py) drawing its own noise, timed alone: us per call as CUDA-graph
replays, bf16 logits over Qwen3's vocabulary, temperature 0.6, at the batch sizes a decode step sees.

    python benchmarks/race_time.py [--batches 1 16 64 256] [--against OTHER_RACE.py ...]

--against: other versions of race.py (files) timed alternately with this one, on the same logits.
"""
import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.timing import time_ms  # noqa: E402
from nanovllm.kernels import race as current  # noqa: E402

VOCAB = 151936


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"race_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--against", nargs="+", default=[], help="other race.py files to time alternately with this one")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the race kernel runs on CPU only under TRITON_INTERPRET=1, too slowly to time)")
    versions = [("this", current)] + [(os.path.basename(path), load(path)) for path in args.against]
    torch.manual_seed(0)
    seed = torch.tensor([1234], dtype=torch.int64, device="cuda")
    for batch in args.batches:
        logits = (torch.randn(batch, VOCAB, device="cuda") * 3).to(torch.bfloat16)
        temps = torch.full((batch, 1), 0.6, device="cuda")
        times = {name: [] for name, _ in versions}
        for _ in range(args.rounds):
            for name, module in versions:
                def call(m=module, lg=logits, tp=temps):
                    return m.race(lg, tp, seed=seed)
                times[name].append(time_ms(call, graph=True) * 1e3)
        row = "  ".join(f"{name} {', '.join(f'{t:6.1f}' for t in ts)}" for name, ts in times.items())
        print(f"batch {batch:4d}  race us/call: {row}  ({logits.numel() * 2 / 1e6:.1f} MB of logits)", flush=True)


if __name__ == "__main__":
    main()
