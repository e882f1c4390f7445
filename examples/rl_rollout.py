"""A small, honest GRPO-style loop on the bundled SmolLM2-135M-Instruct, on CPU.

Each iteration: n samples per prompt from nanovllm; a toy reward (shorter answers score higher); advantages
normalized within each prompt's group; one optimizer step on a transformers copy of the policy; the new weights
pushed into the same engine with update_weights. sleep()/wake_up() hand the engine's KV cache back while the
trainer works, as an RL trainer does with GPU memory.

    python examples/rl_rollout.py                   # 3 iterations, prints the mean reward of each
    python examples/rl_rollout.py --iterations 5 --n 8
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.checkpoint.bundled import default_model_path  # noqa: E402
from nanovllm.checkpoint.loader import resolve_checkpoint  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 3?", "Say hello."]


def rewards_of(outputs: list[dict], max_tokens: int) -> torch.Tensor:
    """[prompts, n]: 1 for an empty answer down to 0 for one that used every token (brevity, a toy goal)."""
    return torch.tensor([[1 - len(o["token_ids"]) / max_tokens for o in out["outputs"]] for out in outputs])


def completion_logprob(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Mean log-probability of `completion` after `prompt` under the trainer's policy (with gradients)."""
    ids = torch.tensor([prompt + completion])
    logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).mean()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the bundled model)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-5)
    args = p.parse_args()
    torch.manual_seed(0)
    model = args.model or default_model_path()

    from transformers import AutoModelForCausalLM
    llm = LLM(model, max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64)
    # The trainer's copy: the same checkpoint in transformers (a GGUF file is read from nanovllm's converted copy).
    policy = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(model), dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]

    for iteration in range(args.iterations):
        t = time.perf_counter()
        sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=iteration)
        outputs = llm.chat(conversations, sampling, use_tqdm=False)  # rollouts: n samples per prompt
        rewards = rewards_of(outputs, args.max_tokens)
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        llm.sleep(level=1)  # the trainer gets the memory while it works
        policy.train()
        losses = [-advantage * completion_logprob(policy, out["prompt_token_ids"], o["token_ids"])
                  for out, row in zip(outputs, advantages) for o, advantage in zip(out["outputs"], row)
                  if o["token_ids"]]
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        llm.update_weights(policy.state_dict())  # names as in the checkpoint; the prefix cache is emptied
        llm.wake_up()
        print(f"iteration {iteration}: mean reward {rewards.mean():.3f}, mean answer length "
              f"{args.max_tokens * (1 - rewards.mean()):.1f} tokens, loss {loss.item():+.4f}, "
              f"{time.perf_counter() - t:.1f} s")
    print("example answer:", outputs[0]["text"].strip()[:80])
    llm.exit()


if __name__ == "__main__":
    main()
