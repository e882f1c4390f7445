"""Hugging Face Hub model ids, as vLLM takes them: `LLM("Qwen/Qwen3-0.6B")` reads the id's snapshot from the local
Hugging Face cache, or downloads it there first (huggingface_hub, which transformers installs). A path that exists
is used as it is."""
import os

# what nanovllm reads from a checkpoint: config.json, generation_config.json and the other JSON files, the
# tokenizer's files (vocab, merges, SentencePiece or tiktoken models, a chat template) and the safetensors weights;
# other weight formats, Meta's original/ folder and Mistral's consolidated*.safetensors (second copies of the weights,
# under the models' own tensor names, which nanovllm does not read) are never read, so never fetched
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
IGNORE_PATTERNS = ["original/*", "consolidated*.safetensors"]
MODEL_FILES = "a local checkpoint directory (config.json + safetensors) or a .gguf file"


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None,
                  hf_token: str | bool | None = None, what: str = "model", local: str = MODEL_FILES) -> str:
    """A local path to `model`: `model` itself where that path exists; else, for a Hub repo id, its snapshot at
    `revision` (None: main) in the Hugging Face cache (`download_dir`, else HF_HUB_CACHE / HF_HOME's), downloaded
    into it when missing or out of date and the Hub is reachable (HF_HUB_OFFLINE=1: the cache only). ValueError
    naming the id when it is no path and no snapshot can be had, with what to do (`what` names the thing,
    `local` says what its local path must be)."""
    if os.path.exists(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(model)
    except HFValidationError:  # (an absolute path, "./x", "a/b/c": a path that is not there, not an id)
        raise ValueError(f"{what} path {model!r} does not exist; pass {local}, or a Hugging Face Hub id such as "
                         "'Qwen/Qwen3-0.6B'") from None
    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir, token=hf_token,
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except Exception as e:  # (not found, gated, offline and not cached, no network, a bad revision, ...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what} {model!r} is not a local path, and its Hugging Face Hub snapshot"
                         f"{'' if revision is None else f' at revision {revision!r}'} could not be read from the "
                         f"cache or downloaded ({type(e).__name__}: {reason}); pass {local}, "
                         f"or fetch it where the Hub is reachable (`hf download {model}`), or check the id, revision "
                         "and hf_token") from e
