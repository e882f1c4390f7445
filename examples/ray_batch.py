"""Batch inference with Ray Data: a JSONL file of prompts in, JSONL or Parquet out.

    python examples/ray_batch.py                                    # examples/prompts.jsonl, the bundled model
    python examples/ray_batch.py prompts.jsonl out.jsonl --model PATH            # a laptop: a local Ray
    RAY_ADDRESS=auto python examples/ray_batch.py prompts.jsonl out/ --format parquet --concurrency 8 --num-gpus 1

Each input line holds "prompt" (text or token ids) or "messages" (a chat), and optionally "sampling_params" (a dict
of SamplingParams fields for that row). Output rows keep every input field and add generated_text,
generated_token_ids, finish_reason and num_cached_tokens. On a cluster, start Ray first (`ray start --head` on one
machine, `ray start --address=HEAD:6379` on the others) and give a model path every machine can read.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm.ray import build_processor  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("input", nargs="?", default=os.path.join(here, "prompts.jsonl"),
                   help="a JSONL file (default: examples/prompts.jsonl)")
    p.add_argument("output", nargs="?", default="out.jsonl", help="a JSONL file, or a folder with --format parquet")
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the bundled model)")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--concurrency", type=int, default=1, help="LLM replicas (Ray actors)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica (0: CPU)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    import ray

    from nanovllm.checkpoint.bundled import default_model_path
    model = os.path.abspath(args.model) if args.model else default_model_path()
    processor = build_processor(model, engine_kwargs={"max_model_len": 2048},
                                sampling_params={"temperature": args.temperature, "max_tokens": args.max_tokens},
                                concurrency=args.concurrency, num_gpus=args.num_gpus, batch_size=args.batch_size)
    ray.init()  # a local Ray, or the cluster named by RAY_ADDRESS
    results = processor(ray.data.read_json(os.path.abspath(args.input)))  # (pyarrow reads JSON lines)
    if args.format == "parquet":
        results.write_parquet(os.path.abspath(args.output))
    else:
        with open(args.output, "w") as f:
            for row in results.iter_rows():
                row = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}
                # fields a row did not have come back as null: leave them out, as in the input
                f.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
