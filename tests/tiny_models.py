"""Tiny random checkpoints made with transformers, saved with a small trained tokenizer; tiny GGUF files."""
import copy
import functools
import json
import os
import random

import torch

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small engine that could generate text quickly.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "Hello world! How are you today? I am fine, thank you.",
    "Ünïcödé text: café, naïve, 東京, Привет, emoji 🙂 and more.",
] * 4

# A ChatML template, as SmolLM2 and Qwen use.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


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


@functools.lru_cache
def spm_tokenizer():
    """A Llama-2 / Mistral style tokenizer (SentencePiece's Metaspace: a word's leading space is part of its token,
    and dropped when a decode starts with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>", "<pad>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


@functools.lru_cache
def byte_fallback_tokenizer():
    """A Llama-2 / Mistral / Gemma style tokenizer: SentencePiece BPE with byte fallback (a character outside the
    vocabulary, here every non-ASCII one, is one <0xNN> token per UTF-8 byte; decoding turns a run of byte tokens
    that is not valid UTF-8 into U+FFFD, every byte of it) and a decoder that strips the text's leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([text for text in CORPUS if text.isascii()], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_checkpoint(path, arch: str = "qwen3", tie: bool = True, num_kv_heads: int = 2, num_heads: int = 4,
                    head_dim: int | None = None, hidden: int = 64, layers: int = 2, seed: int = 0,
                    chat_template: str | None = None, tokenizer=None, **extra) -> str:
    """Save a tiny random model plus tokenizer (the byte-level BPE `_tokenizer()` unless given) into `path`; returns
    the path as str. arch: qwen3, qwen2, llama, mistral, qwen3_moe, mixtral, gemma2 or gemma3 (Gemma3ForCausalLM);
    extra: more config fields (rope_scaling, sliding_window, num_experts, ...)."""
    import transformers
    from transformers import AutoModelForCausalLM
    tok = tokenizer or _tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
                  tie_word_embeddings=tie, initializer_range=0.25, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-6)
    cls = getattr(transformers, {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig",
                                 "mistral": "MistralConfig", "qwen3_moe": "Qwen3MoeConfig",
                                 "mixtral": "MixtralConfig", "gemma2": "Gemma2Config",
                                 "gemma3": "Gemma3TextConfig"}[arch])
    if arch != "qwen2":
        common["head_dim"] = head_dim or hidden // num_heads
    common.update(copy.deepcopy(extra))  # (transformers' config classes write into the dicts they are given)
    config = cls(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases are zero at init, and Gemma's norm weights (1 + w): make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or (arch.startswith("gemma") and name.endswith("norm.weight")):
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    tok.chat_template = None  # the tokenizer is cached and shared
    return os.fspath(path)


# A multimodal checkpoint's tiny vision towers (their weights are saved, and skipped by nanovllm)
VISION_CONFIGS = {
    "gemma3": dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=14),
    "mistral3": dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, head_dim=16, image_size=28, patch_size=14),
}


def make_multimodal_checkpoint(path, arch: str = "gemma3", tie: bool = True, seed: int = 0, **text) -> str:
    """Save a tiny random Gemma3ForConditionalGeneration (arch "gemma3") or Mistral3ForConditionalGeneration
    ("mistral3") with the byte-level BPE tokenizer into `path`, as transformers' save_pretrained writes it (the
    language model's tensors as language_model.model.* and language_model.lm_head.*, the vision tower's and the
    projector's beside them); returns the path as str. text: the text_config's sizes and fields (4 layers, hidden 64,
    4 query and 2 KV heads of 16 unless given). Its vocabulary is the tokenizer's plus four ids: Gemma's begin- and
    end-of-image tokens and the image token (Mistral's image token is the first of them); tie: the top-level
    tie_word_embeddings (Mistral3's text_config says untied, as Mistral Small's)."""
    import transformers
    tok = _tokenizer()
    n = len(tok)
    text = {**dict(vocab_size=n + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                   initializer_range=0.25, eos_token_id=tok.eos_token_id, bos_token_id=None,
                   pad_token_id=tok.pad_token_id), **text}
    if arch == "gemma3":
        config = transformers.Gemma3Config(text_config=text, vision_config=VISION_CONFIGS[arch], mm_tokens_per_image=4,
                                           boi_token_index=n, eoi_token_index=n + 1, image_token_index=n + 2,
                                           tie_word_embeddings=tie, initializer_range=text["initializer_range"])
    else:
        config = transformers.Mistral3Config(text_config={"model_type": "mistral", "sliding_window": None, **text},
                                             vision_config=VISION_CONFIGS[arch], image_token_index=n,
                                             tie_word_embeddings=tie)
    torch.manual_seed(seed)
    cls = {"gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}[arch]
    model = getattr(transformers, cls)(config).eval()
    if arch == "gemma3":
        with torch.no_grad():  # Gemma's norm weights (1 + w) are zero at init: make them matter; and embeddings
            # small enough (scaled by sqrt(hidden) in the model) that a tied LM head does not just repeat the input
            for name, p in model.named_parameters():
                if "language_model" in name and name.endswith("norm.weight"):
                    p.normal_(0, 0.08)
            model.model.language_model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return os.fspath(path)


def load_hf_model(path: str):
    """A new transformers float32 model of a checkpoint directory, a multimodal one's as a whole (image-text-to-text;
    hf_model: a cached one, not to be changed). A
    soft-capped model (Gemma 2) runs transformers' eager attention: some releases' default sdpa path drops the
    soft-cap without a word (5.17: other tokens from the 3rd of a continuation in test_sliding_window.py), later
    ones refuse it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(path)
    soft_capped = getattr(config, "attn_logit_softcapping", None) is not None
    kwargs = {"attn_implementation": "eager"} if soft_capped else {}
    auto = AutoModelForImageTextToText if getattr(config, "text_config", None) is not None else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


hf_model = functools.lru_cache(maxsize=8)(load_hf_model)


@functools.lru_cache(maxsize=4)
def hf_gguf_model(gguf_path: str):
    """transformers' own reading of a GGUF file (dequantized, q/k permutation undone), in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        import accelerate  # noqa: F401  (transformers' from_pretrained(gguf_file=...) requires it)
    except ImportError:
        # Without accelerate: the same transformers GGUF reader that from_pretrained uses, by hand.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name),
                                                 dtype=torch.float32)
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Prompts of random token ids in [3, 400) (past the special tokens), one of each length."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` from a checkpoint directory or a .gguf file."""
    model = hf_gguf_model(path) if path.endswith(".gguf") else hf_model(path)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _permute_for_gguf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter order for Llama q/k rows: per head, the two rope halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def make_gguf(checkpoint: str, path, chat_template: str | None = CHAT_TEMPLATE,
              extra_tensors: dict | None = None) -> str:
    """Write a tiny Llama or Qwen2 checkpoint directory as an F32 GGUF file, laid out as llama.cpp's converter does
    (which permutes the q/k rows of Llama models only). extra_tensors: more tensors, {GGUF name: numpy array}."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer
    config = AutoConfig.from_pretrained(checkpoint)
    arch = config.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError("make_gguf writes Llama and Qwen2 checkpoints only")
    tok = AutoTokenizer.from_pretrained(checkpoint)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    path = os.fspath(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # The tokenizer, as llama.cpp stores a GPT-2 style byte-level BPE.
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    specials = set(tok.all_special_tokens)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, w in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        if arch == "llama" and base.endswith("q_proj"):
            w = _permute_for_gguf(w, config.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            w = _permute_for_gguf(w, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", w.float().numpy())
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def edit_json(file: str, **changes) -> None:
    """Rewrite fields of a JSON object file (a config.json, an adapter_config.json); None deletes one."""
    import json
    with open(file) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(file, "w") as f:
        json.dump(data, f)
