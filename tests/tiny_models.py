"""Tiny random checkpoints made with transformers, saved with a small trained tokenizer."""
import functools
import os

import torch

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small engine that could generate text quickly.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "Hello world! How are you today? I am fine, thank you.",
    "Ünïcödé text: café, naïve, 東京, Привет, emoji 🙂 and more.",
] * 4


@functools.lru_cache
def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def make_checkpoint(path, arch: str = "qwen3", tie: bool = True, num_kv_heads: int = 2, num_heads: int = 4,
                    head_dim: int | None = None, hidden: int = 64, layers: int = 2, seed: int = 0,
                    **extra) -> str:
    """Save a tiny random model plus tokenizer into `path`; returns the path as str."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    tok = _tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
                  tie_word_embeddings=tie, initializer_range=0.25, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-6)
    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    if arch != "qwen2":
        common["head_dim"] = head_dim or hidden // num_heads
    common.update(extra)
    config = cls(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases are zero at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return os.fspath(path)


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
