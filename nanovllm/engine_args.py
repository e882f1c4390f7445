"""vLLM's EngineArgs: the model and LLM(...)'s options, from code or a command line (add_cli_args, from_cli_args),
for LLMEngine.from_engine_args."""
import argparse
import dataclasses
import json
import re
import types
import typing
from dataclasses import fields

from nanovllm.config import Config
from nanovllm.llm import LLM
from nanovllm.vllm_options import ALIASES, DEFAULT_ONLY, HUB_OPTIONS, NO_EFFECT, same_value

# vLLM's options that LLM(...) takes by name and are no Config field (vllm_options.py), as vLLM's command line types
# them where their default does not say: a vLLM script's --trust-remote-code, --disable-log-stats or --tokenizer
# parses, and LLM(...) then ignores, maps or refuses each as it does in code
_VLLM_TYPES = {"trust_remote_code": bool, "disable_custom_all_reduce": bool, "enable_sleep_mode": bool,
               "disable_log_stats": bool, "use_tqdm_on_load": bool, "disable_cascade_attn": bool,
               "enable_chunked_prefill": bool, "disable_async_output_proc": bool, "max_logprobs": int,
               "max_parallel_loading_workers": int, "max_seq_len_to_capture": int, "swap_space": float,
               "cpu_offload_gb": float, "tokenizer": str, "optimization_level": int}
# vLLM's defaults of the options LLM(...) takes by name that have none in Config or DEFAULT_ONLY: what EngineArgs
# reads for one left out, as vLLM's EngineArgs does
_VLLM_DEFAULTS = {"tokenizer": None, "trust_remote_code": False, "disable_custom_all_reduce": False,
                  "enable_sleep_mode": False, "disable_log_stats": False, "max_logprobs": 20,
                  "guided_decoding_backend": None, "structured_outputs_config": None, "served_model_name": None,
                  "use_tqdm_on_load": True, "max_parallel_loading_workers": None, "disable_cascade_attn": False,
                  "max_seq_len_to_capture": 8192, "enable_chunked_prefill": None, "disable_async_output_proc": False,
                  "optimization_level": 2}

# vLLM's short flags for these options (-tp 2 is --tensor-parallel-size 2; -O0 is --optimization-level 0)
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
                "quantization": "-q", "optimization_level": "-O", "compilation_config": "-cc"}

# options vLLM's command line reads as sizes (human_readable_int)
_SIZES = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int | None:
    """A size as vLLM's command line reads one: '1k' is 1000 and '25.6k' 25600 (decimal suffixes k, m, g, t), '32K'
    is 32768 (binary suffixes K, M, G, T, whole numbers only), a plain number is itself; 'None' or '' is None (the
    option's default)."""
    value = value.strip()
    if value in ("", "None"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value)
    if match is None:
        return int(value)  # (argparse reports a ValueError as an invalid value)
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix}; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * _BINARY_SUFFIXES[suffix]

# options vLLM's command line reads as JSON (dicts, or a config's fields)
_JSON = ("hf_overrides", "limit_mm_per_prompt", "mm_processor_kwargs", "override_generation_config",
         "compilation_config", "speculative_config", "kv_transfer_config", "pooler_config", "override_pooler_config",
         "structured_outputs_config")


def json_value(value: str):
    """A JSON-valued option as vLLM's command line reads one: '{"a": 1}' is that dict (a bad one is argparse's
    error), '3' is 3; 'None' or '' is None (the default); other text stays text."""
    if value.strip() in ("", "None"):
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        if value.lstrip().startswith(("{", "[")):
            raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON: {e}") from None
        return value


def _options() -> dict[str, tuple[object, object]]:
    """Option name -> (the type its command-line value parses as, LLM(...)'s default): Config's fields (under vLLM's
    names too), vLLM's default-only options and the other vLLM options LLM(...) takes; str for an option of several
    types, sizes as human_readable_int, dicts and configs as json_value."""
    kinds, defaults = {}, {}
    for f in fields(Config):
        if f.init and f.name != "model":
            types_ = [k for k in typing.get_args(f.type) if k is not type(None)] if isinstance(
                f.type, types.UnionType) else [f.type]
            kinds[f.name] = types_[0] if len(types_) == 1 and types_[0] in (int, float, bool) else str
            defaults[f.name] = f.default
    for vllm, ours in ALIASES.items():
        kinds[vllm], defaults[vllm] = kinds[ours], defaults[ours]
    for name in (*DEFAULT_ONLY, *NO_EFFECT, *HUB_OPTIONS, *_VLLM_TYPES):
        default = DEFAULT_ONLY[name][0] if name in DEFAULT_ONLY else _VLLM_DEFAULTS.get(name)
        kinds[name] = _VLLM_TYPES.get(name, type(default) if type(default) in (bool, int) else str)
        defaults[name] = default
    kinds.update(dict.fromkeys(_SIZES, human_readable_int))
    kinds.update(dict.fromkeys(_JSON, json_value))
    return {name: (kinds[name], defaults[name]) for name in kinds}


# every option EngineArgs has a field and a command-line flag for
_OPTIONS = _options()


class _EngineArgs:
    """EngineArgs' methods (EngineArgs, the dataclass, is made below from _OPTIONS)."""

    @property
    def options(self) -> dict[str, object]:
        """The options not at LLM(...)'s default, as LLM(model, **options) takes them."""
        return {name: getattr(self, name) for name, (_, default) in _OPTIONS.items()
                if not same_value(getattr(self, name), default)}

    def __getattr__(self, name: str):  # (only for a name that is no field or method)
        raise AttributeError(f"EngineArgs has no option {name!r}")

    def __repr__(self) -> str:
        return f"EngineArgs(model={self.model!r}{''.join(f', {k}={v!r}' for k, v in self.options.items())})"

    def make_llm(self) -> LLM:
        """The LLM these arguments describe (the same as LLM(**dataclasses.asdict(self))). data_parallel_size > 1 is
        refused: its replicas serve whole generate() calls, not an engine's steps."""
        if self.data_parallel_size not in (1, None):
            raise ValueError("LLMEngine.from_engine_args: data_parallel_size > 1 is not supported (its replicas serve "
                             "whole generate() calls); use LLM(..., data_parallel_size=N).generate, or "
                             "tensor_parallel_size for one engine over several GPUs")
        return LLM(self.model, **self.options)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """--model and one --flag per option (nanovllm's Config fields, and vLLM's names LLM(...) takes:
        --block-size, --num-gpu-blocks-override, --trust-remote-code, ...; vLLM's short flags -tp, -pp, -dp, -q, -O
        and -cc too); an option left out of the command line keeps LLM's default. --model may be left out too, or
        set with parser.set_defaults(model=...) as vLLM's examples do (LLM's default: the bundled SmolLM2-135M)."""
        parser.add_argument("--model", help="a local checkpoint directory (or .gguf file) or a Hugging Face Hub "
                            "id; default: the bundled SmolLM2-135M")
        for name, (kind, _) in _OPTIONS.items():
            flags = ["--" + name.replace("_", "-"), *([_SHORT_FLAGS[name]] if name in _SHORT_FLAGS else [])]
            if kind is bool:
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
            else:
                parser.add_argument(*flags, type=kind, default=argparse.SUPPRESS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The options add_cli_args added that the command line set (other attributes of `args` are the script's)."""
        return cls(args.model, **{k: v for k, v in vars(args).items() if k in _OPTIONS})


# vLLM's EngineArgs is a dataclass: scripts build LLM(**dataclasses.asdict(engine_args)), or change one option with
# dataclasses.replace(engine_args, ...). Its fields: the model, then every option at LLM(...)'s default (a name that
# is no option raises TypeError, as vLLM's does)
EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [("model", str | None, None), *((name, typing.Any, default)
                                                  for name, (_, default) in _OPTIONS.items())],
    bases=(_EngineArgs,), repr=False, namespace={
        "__module__": __name__,
        "__doc__": "vLLM's EngineArgs: the model and LLM(...)'s options (nanovllm's, and vLLM's names it takes: "
                   "docs/usage.md, docs/vllm_compat.md), each a field at LLM's default unless set, checked when "
                   "LLMEngine.from_engine_args (or LLM(**dataclasses.asdict(engine_args))) makes the engine. No "
                   "model: LLM()'s, the bundled SmolLM2-135M."})
