"""What an RL loop on CPU pays around the steps: weight updates of a few matrices and of all, and how long
`llm.exit()` takes with tensor-parallel workers and data-parallel replicas.

    python benchmarks/cpu_lifecycle.py [--repeat 2]

- update_weights of one down_proj (bundled SmolLM2, float32, oneDNN-packed weights), the first and later calls of
  one engine, against unpacking and packing all 121 matrices (layers/cpu_weights.py);
- llm.exit() of tensor_parallel_size=2 and of data_parallel_size=2 engines on a tiny random Qwen3 checkpoint
  (tests/tiny_models.py), after a few generated tokens.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.checkpoint.bundled import default_model_path  # noqa: E402
from nanovllm.layers import cpu_weights  # noqa: E402


def weight_updates(repeat: int) -> list[str]:
    llm = LLM(default_model_path())
    model = llm.executor.runner.model
    name = "model.layers.0.mlp.down_proj.weight"
    weight = dict(model.named_parameters())[name].to_dense().clone()
    rows = []
    for i in range(repeat):
        t = time.perf_counter()
        llm.update_weights([(name, weight)])
        one = time.perf_counter() - t
        t = time.perf_counter()
        cpu_weights.unpack(model)
        cpu_weights.pack(model)
        everything = time.perf_counter() - t
        rows.append(f"update_weights of one matrix, call {i + 1}: {one * 1e3:7.1f} ms; "
                    f"unpack + pack of all: {everything * 1e3:7.1f} ms")
        print(rows[-1], flush=True)
    llm.exit()
    return rows


def exits(repeat: int) -> list[str]:
    from tests.tiny_models import make_checkpoint
    path = make_checkpoint(tempfile.mkdtemp(prefix="nanovllm-lifecycle-"), "qwen3", tie=True, num_kv_heads=2)
    rows = []
    for kind in ("tensor_parallel_size", "data_parallel_size"):
        for i in range(repeat):
            llm = LLM(path, device="cpu", max_model_len=256, **{kind: 2})
            llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
            t = time.perf_counter()
            llm.exit()
            rows.append(f"llm.exit() with {kind}=2, engine {i + 1}: {time.perf_counter() - t:.2f} s")
            print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    rows = weight_updates(args.repeat) + exits(args.repeat)
    print("\n== cpu lifecycle ==\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
