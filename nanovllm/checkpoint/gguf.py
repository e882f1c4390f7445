"""GGUF files as checkpoints: converted once into a cached Hugging Face style directory.

Reading a GGUF's metadata with the `gguf` package and building its tokenizer take several seconds, so the
first load writes config.json, generation_config.json, the tokenizer files and float32 safetensors into
`$NANOVLLM_CACHE/gguf/<name>-<key>/` (default `~/.cache/nanovllm`); later loads read that directory like
any other checkpoint. The key covers the file's name, size, mtime and its first and last MiB, not its path: the same
file installed in several virtual environments (the bundled model) shares one entry. An edited file converts again
(and the entry it left is removed)."""
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from time import perf_counter

import torch

logger = logging.getLogger("nanovllm")

GGUF_MAGIC = b"GGUF"
_CONVERTER_VERSION = 4  # bump when the cached layout, the conversion or the key changes
_SOURCE_FILE = "gguf_source.json"  # in each cache entry: which file it came from

# general.architecture -> the Hugging Face class our registry builds for it
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_root() -> str:
    return os.environ.get("NANOVLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanovllm")


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("loading a .gguf file needs the `gguf` package: pip install gguf") from e
    return gguf


def check_gguf_file(path: str) -> None:
    """Clear errors for a path that cannot be a GGUF file, before any slow work."""
    if not os.path.exists(path):
        raise ValueError(f"GGUF file {path!r} does not exist; check the path")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file; pass a .gguf file or a checkpoint directory")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
                         "file or a checkpoint directory with config.json and *.safetensors")


def gguf_checkpoint_dir(path: str) -> str:
    """The cached checkpoint directory for a GGUF file, converting the file on first use."""
    path = os.path.abspath(path)
    check_gguf_file(path)
    st = os.stat(path)
    identity = {"name": os.path.basename(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "fingerprint": _fingerprint(path, st.st_size), "version": _CONVERTER_VERSION}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    source = {**identity, "path": path}
    root = os.path.join(cache_root(), "gguf")
    stem = os.path.splitext(os.path.basename(path))[0]
    target = os.path.join(root, f"{stem}-{key}")
    if os.path.isfile(os.path.join(target, _SOURCE_FILE)):
        return target
    os.makedirs(root, exist_ok=True)
    # Convert into a private directory, then rename: a crash or a concurrent loader never sees half a cache.
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=root)
    try:
        start = perf_counter()
        convert_gguf(path, tmp)
        with open(os.path.join(tmp, _SOURCE_FILE), "w") as f:
            json.dump(source, f)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, _SOURCE_FILE)):  # not a concurrent winner: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s in %.1fs; cached in %s", path, perf_counter() - start, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale_entries(root, stem, path, target)
    return target


def _fingerprint(path: str, size: int, span: int = 1 << 20) -> str:
    """sha256 of the file's first and last `span` bytes (the whole of a small file): milliseconds, where hashing
    a large GGUF whole would take seconds at every start."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return h.hexdigest()


def _remove_stale_entries(root: str, stem: str, path: str, keep: str) -> None:
    """Drop cache entries converted from an older version of the same file."""
    for name in os.listdir(root):
        entry = os.path.join(root, name)
        if entry == keep or not name.startswith(stem + "-"):
            continue
        try:
            with open(os.path.join(entry, _SOURCE_FILE)) as f:
                if json.load(f).get("path") == path:
                    shutil.rmtree(entry, ignore_errors=True)
        except (OSError, ValueError):
            continue


def convert_gguf(path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json, tokenizer files and model.safetensors for `path`."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated or garbled files
        raise ValueError(f"cannot read GGUF file {path!r} ({type(e).__name__}: {e}); the file is corrupt or "
                         "truncated: copy or download it again") from e
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        # (Gemma runs from its safetensors checkpoints; llama.cpp's Gemma files store norms as 1 + w, among others)
        hint = " (load Gemma from its Hugging Face checkpoint directory)" if str(arch).startswith("gemma") else ""
        raise ValueError(f"GGUF architecture {arch!r} is not supported{hint}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(meta, arch, tensor_names)
    config.save_pretrained(out_dir)
    eos_ids = [i for i in (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None]
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(dict.fromkeys(eos_ids)), "bos_token_id": config.bos_token_id}, f, indent=2)
    _save_tokenizer(path, out_dir)
    _save_weights(reader, config, arch, path, os.path.join(out_dir, "model.safetensors"))


class _Metadata:
    """Scalar and string metadata by key (big arrays, like the vocabulary, are never decoded here)."""

    def __init__(self, reader):
        self.reader = reader

    def get(self, key: str, default=None):
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def count(self, key: str) -> int | None:
        field = self.reader.get_field(key)
        return None if field is None else len(field.data)


def _hf_config(meta: _Metadata, arch: str, tensor_names: set[str]):
    from transformers import AutoConfig

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only unscaled rope)")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1+ files store their rope scaling only as per-frequency factors; transformers ignores
        # them too, which is exact for positions well inside the original context.
        logger.warning("GGUF file has rope_freqs (Llama 3 rope scaling); it is ignored, as transformers does")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = meta.count("tokenizer.ggml.tokens") or key("vocab_size")
    fields = dict(
        architectures=[GGUF_ARCHITECTURES[arch]],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length") or key("rope.dimension_count") or (hidden and heads and hidden // heads),
        max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(key("rope.freq_base", 10000.0)),  # transformers 5 moves it into rope_parameters
        vocab_size=vocab,
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        # no dtype: a quantized file has none to keep, so the engine's default applies (float32 on CPU,
        # bfloat16 on CUDA); dtype="float32" is exact on a GPU too
    )
    if arch == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    missing = [k for k, v in fields.items() if v is None and not k.endswith("token_id")]
    if missing:
        raise ValueError(f"GGUF file lacks metadata for {', '.join(missing)}; is it a complete {arch} model file?")
    return AutoConfig.for_model(arch, **fields)


# A GGUF conversion records the tokenizer class AutoTokenizer picked for it (_save_tokenizer). When that is one of
# transformers' generic classes, later loads name the class directly: importing AutoTokenizer pulls in transformers'
# model registry and generation stack, seconds on a small CPU, where the class alone imports in a fraction of one.
TOKENIZER_RECORD = "nanovllm_tokenizer.json"
DIRECT_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def recorded_tokenizer_class(path: str) -> str | None:
    """The class AutoTokenizer picked for the checkpoint at `path`, as recorded there under the same transformers
    version, if it is a generic class that can be named directly; else None."""
    from importlib.metadata import version
    try:
        with open(os.path.join(path, TOKENIZER_RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    name = record.get("tokenizer_class") if isinstance(record, dict) else None
    if name not in DIRECT_TOKENIZER_CLASSES or record.get("transformers") != version("transformers"):
        return None
    return name


def _save_tokenizer(path: str, out_dir: str) -> None:
    """The GGUF's tokenizer as Hugging Face files, and which class AutoTokenizer builds from them
    (TOKENIZER_RECORD: later loads may name that class instead of importing AutoTokenizer)."""
    from importlib.metadata import version

    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from GGUF file {path!r}: {type(e).__name__}: {e}") from e
    tokenizer.save_pretrained(out_dir)
    picked = type(AutoTokenizer.from_pretrained(out_dir)).__name__
    with open(os.path.join(out_dir, TOKENIZER_RECORD), "w") as f:
        json.dump({"tokenizer_class": picked, "transformers": version("transformers")}, f)  # (as read back)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the model does not use."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    m = _BLOCK_NAME.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the supported decoder models "
                     f"({', '.join(GGUF_ARCHITECTURES)})")


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for Llama GGUFs.

    llama.cpp's converter reorders each head's rows from the two-halves rope layout that Hugging Face uses to
    an interleaved (pair-wise) one: rows (head, half, i) are stored at (head, i, half). Shape [rows, ...]."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _save_weights(reader, config, arch: str, path: str, out_file: str) -> None:
    import numpy as np
    from gguf import dequantize
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-moving first
        try:
            array = dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)  # copy: F32 data is a read-only map
        except Exception as e:
            raise ValueError(f"cannot read tensor {t.name!r} ({t.tensor_type.name}) of GGUF file {path!r} "
                             f"({type(e).__name__}: {e}); the file is corrupt, truncated or uses an unsupported "
                             "quantization") from e
        if arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_q.bias")):
            w = _unpermute_rope(w, config.num_attention_heads)
        elif arch == "llama" and t.name.endswith((".attn_k.weight", ".attn_k.bias")):
            w = _unpermute_rope(w, config.num_key_value_heads)
        tensors[name] = w.contiguous()
    save_file(tensors, out_file, metadata={"format": "pt"})
