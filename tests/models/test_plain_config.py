"""The plain config.json reader (checkpoint/plain_config.py) against transformers' AutoConfig: on every checkpoint
the suite can build and on tricky config.json variants it either agrees with AutoConfig on every field the engine
reads (HF_CONFIG_FIELDS) or declines; the engine reads no other field; a plain-readable checkpoint's Config, and a
whole engine, never import transformers on the main thread; the config pickles."""
import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint import loader
from nanovllm.checkpoint.plain_config import HF_CONFIG_FIELDS, PlainConfig, read_plain_config
from nanovllm.config import Config
from nanovllm.distributed.tensor_parallel import check_tensor_parallel
from tests.models.test_models import LLAMA3_ROPE
from tests.tiny_models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARK_CONFIGS = ROOT / "benchmarks" / "configs"
ABSENT = "<absent>"  # a field the config does not have

# name -> (make_checkpoint arguments, whether the plain reader takes it)
CHECKPOINTS = {
    "qwen3": (dict(arch="qwen3"), True),
    "qwen3_bias_untied": (dict(arch="qwen3", tie=False, num_kv_heads=4, attention_bias=True), True),
    "qwen2": (dict(arch="qwen2"), True),
    "llama": (dict(arch="llama", tie=False, attention_bias=True, mlp_bias=True), True),
    "llama3_rope": (dict(arch="llama", rope_scaling=LLAMA3_ROPE, head_dim=32), False),
    "mistral": (dict(arch="mistral", sliding_window=None), True),
    "qwen3_moe": (dict(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), False),
    "mixtral": (dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2), False),
}


def engine_view(config) -> dict:
    """What the engine can read from `config`: each field's value, or ABSENT."""
    return {name: getattr(config, name, ABSENT) for name in HF_CONFIG_FIELDS}


def auto_config(path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def check_agrees_or_declines(path, expect_plain: bool) -> PlainConfig | None:
    plain = read_plain_config(os.fspath(path))
    assert (plain is not None) == expect_plain, plain
    if plain is not None:
        assert engine_view(plain) == engine_view(auto_config(path))
    return plain


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("plain_config")
    return {name: make_checkpoint(root / name, **kwargs) for name, (kwargs, _) in CHECKPOINTS.items()}


# ---- (a) every checkpoint the suite builds -------------------------------------------------------

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tiny_checkpoints(checkpoints, name):
    check_agrees_or_declines(checkpoints[name], CHECKPOINTS[name][1])


@pytest.mark.parametrize("name, expect_plain", [("qwen3-0.6b", True), ("qwen3-8b", True), ("qwen3-30b-a3b", False),
                                                ("gemma3-1b", False)])
def test_benchmark_configs(name, expect_plain):
    check_agrees_or_declines(BENCHMARK_CONFIGS / name, expect_plain)


def test_converted_gguf_files(tmp_path, monkeypatch, checkpoints):
    pytest.importorskip("gguf")
    from nanovllm.checkpoint.gguf import gguf_checkpoint_dir
    from tests.tiny_models import make_gguf
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    for name in ("llama", "qwen2"):
        check_agrees_or_declines(gguf_checkpoint_dir(make_gguf(checkpoints[name], tmp_path / f"{name}.gguf")), True)


def test_bundled_model_is_read_plainly(bundled, bundled_gguf_cache, monkeypatch):
    """The start-up case: the bundled SmolLM2 (its converted config.json) needs no transformers."""
    from nanovllm.checkpoint.gguf import gguf_checkpoint_dir
    monkeypatch.setenv("NANOVLLM_CACHE", bundled_gguf_cache)
    plain = check_agrees_or_declines(gguf_checkpoint_dir(bundled), True)
    assert plain.architectures == ["LlamaForCausalLM"] and plain.tie_word_embeddings


# ---- (b) tricky config.json variants ---------------------------------------------------------------

def _base(model_type: str) -> dict:
    """A complete config.json of each family (Qwen3-0.6B's, with the architecture and model_type swapped)."""
    config = json.loads((BENCHMARK_CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM"}[model_type]
    return {**config, "model_type": model_type, "architectures": [arch]}


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


QWEN3, QWEN2, LLAMA, MISTRAL = (_base(t) for t in ("qwen3", "qwen2", "llama", "mistral"))
# name -> (config.json, whether the plain reader takes it)
VARIANTS = {
    "qwen3 without head_dim (Qwen3Config: 128, the engine: hidden/heads)": (_without(QWEN3, "head_dim"), False),
    "qwen3 head_dim null": ({**QWEN3, "head_dim": None}, False),
    "qwen2 use_sliding_window false, window 4096": ({**QWEN2, "use_sliding_window": False, "sliding_window": 4096},
                                                    True),
    "qwen2 use_sliding_window true, window 4096": ({**QWEN2, "use_sliding_window": True, "sliding_window": 4096},
                                                   False),  # (transformers gives its layer_types)
    "qwen2 use_sliding_window true, no window": (_without({**QWEN2, "use_sliding_window": True}, "sliding_window"),
                                                 False),
    "qwen3 window 4096, no use_sliding_window": (_without({**QWEN3, "sliding_window": 4096}, "use_sliding_window"),
                                                 True),
    "qwen2 head_dim (not a Qwen2Config field: kept)": ({**QWEN2, "head_dim": 32}, True),
    "llama rope_scaling llama3": ({**LLAMA, "rope_scaling": {**LLAMA3_ROPE, "rope_theta": 500000.0}}, False),
    "llama rope_parameters llama3": (_without({**LLAMA, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}},
                                              "rope_scaling", "rope_theta"), False),
    "qwen3 rope_scaling yarn": ({**QWEN3, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768}}, False),
    "qwen3 rope_parameters default beside rope_theta": ({**QWEN3, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 5e5}}, True),
    "qwen3 rope_parameters without rope_type": (_without({**QWEN3, "rope_parameters": {"rope_theta": 5e5}},
                                                         "rope_theta"), True),
    "qwen3 no rope fields at all": (_without(QWEN3, "rope_theta", "rope_scaling"), True),
    "qwen3 partial_rotary_factor": ({**QWEN3, "partial_rotary_factor": 0.5}, False),
    **{f"{name} without num_key_value_heads": (_without(base, "num_key_value_heads"), False)
       for name, base in (("qwen3", QWEN3), ("qwen2", QWEN2), ("llama", LLAMA), ("mistral", MISTRAL))},
    "v4 torch_dtype only": (_without({**QWEN3, "torch_dtype": "bfloat16"}, "dtype"), True),
    "v5 dtype only": (_without({**QWEN3, "dtype": "float16"}, "torch_dtype"), True),
    "dtype and torch_dtype (dtype wins)": ({**QWEN3, "dtype": "float16", "torch_dtype": "bfloat16"}, True),
    "dtype null, torch_dtype float32": ({**QWEN3, "dtype": None, "torch_dtype": "float32"}, True),
    "no dtype": (_without(QWEN3, "dtype", "torch_dtype"), True),
    "dtype auto": ({**QWEN3, "torch_dtype": "auto"}, False),
    "llama without eos_token_id (LlamaConfig: 2)": (_without(LLAMA, "eos_token_id"), False),
    "qwen3 without eos_token_id (None)": (_without(QWEN3, "eos_token_id"), True),
    "qwen3 eos_token_id list": ({**QWEN3, "eos_token_id": [151645, 151643]}, True),
    "llama without head_dim": (_without(LLAMA, "head_dim"), True),
    "llama head_dim null": ({**LLAMA, "head_dim": None}, True),
    "llama hidden_size not a multiple of heads": (_without({**LLAMA, "hidden_size": 1000}, "head_dim"), False),
    "llama sliding_window (not a LlamaConfig field: kept)": ({**LLAMA, "sliding_window": 4096}, True),
    "llama without attention_bias, mlp_bias, hidden_act, tie_word_embeddings": (
        _without(LLAMA, "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings"), True),
    "qwen3 without attention_bias, hidden_act, tie_word_embeddings": (
        _without(QWEN3, "attention_bias", "hidden_act", "tie_word_embeddings"), True),
    "qwen2 without hidden_act, tie_word_embeddings, sliding window fields": (
        _without(QWEN2, "hidden_act", "tie_word_embeddings", "sliding_window", "use_sliding_window"), True),
    "mistral without sliding_window (MistralConfig: 4096)": (_without(MISTRAL, "sliding_window"), False),
    "mistral sliding_window null, biases (kept)": ({**MISTRAL, "sliding_window": None, "attention_bias": True,
                                                    "mlp_bias": True}, True),
    "qwen3 with MoE fields (kept)": ({**QWEN3, "num_experts": 8, "moe_intermediate_size": 96}, True),
    "qwen3 without architectures": (_without(QWEN3, "architectures"), True),
    "tie_word_embeddings a string": ({**QWEN3, "tie_word_embeddings": "yes"}, False),
    "hidden_size a string": ({**QWEN3, "hidden_size": "1024"}, False),
    "no model_type": (_without(QWEN3, "model_type"), False),
    "qwen3_moe": (json.loads((BENCHMARK_CONFIGS / "qwen3-30b-a3b" / "config.json").read_text()), False),
    "auto_map": ({**QWEN3, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}, False),
    # (a multimodal checkpoint's nested text model: transformers makes it a config class of its own)
    "mistral with a text_config": ({**MISTRAL, "text_config": _without(MISTRAL, "architectures")}, False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variants(tmp_path, name):
    config, expect_plain = VARIANTS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_agrees_or_declines(tmp_path, expect_plain)


def test_declined_config_is_read_by_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_without(QWEN3, "head_dim")))
    config = loader.load_hf_config(str(tmp_path))
    assert not isinstance(config, PlainConfig) and config.head_dim == 128


def test_bad_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        loader.load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json holds a JSON list"):
        loader.load_hf_config(str(tmp_path))


# ---- the engine reads only HF_CONFIG_FIELDS ------------------------------------------------------------

class _Recorder:
    """A config that notes the name of every attribute read from it."""

    def __init__(self, config, names: set):
        self.__dict__.update(_config=config, _names=names)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._names.add(name)
        return getattr(self._config, name)


@pytest.mark.parametrize("name", ["qwen3_bias_untied", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral"])
def test_engine_reads_only_the_listed_fields(checkpoints, monkeypatch, name):
    names: set[str] = set()
    monkeypatch.setattr(loader, "load_hf_config",
                        lambda model, overrides: _Recorder(auto_config(loader.resolve_checkpoint(model)), names))
    with LLM(checkpoints[name], num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=128) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        config = copy.copy(llm.config)
    config.tensor_parallel_size = 2
    check_tensor_parallel(config)
    assert names and names <= set(HF_CONFIG_FIELDS), sorted(names - set(HF_CONFIG_FIELDS))


# ---- (c) no transformers on the main thread ----------------------------------------------------------------

def _run(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_config_does_not_import_transformers(checkpoints):
    out = _run("import sys\n"
               "from nanovllm.config import Config\n"
               "config = Config(sys.argv[1])\n"
               "print(type(config.hf_config).__name__, 'transformers' in sys.modules)\n", checkpoints["qwen3"])
    assert out.split() == ["PlainConfig", "False"]


def test_engine_without_tokenizer_does_not_import_transformers(tmp_path, checkpoints):
    bare = tmp_path / "bare"  # config.json alone, random weights: nothing should need transformers
    bare.mkdir()
    (bare / "config.json").write_text(Path(checkpoints["qwen3"], "config.json").read_text())
    out = _run("import sys\n"
               "from nanovllm import LLM, SamplingParams\n"
               "llm = LLM(sys.argv[1], load_format='dummy', num_kvcache_blocks=8, kvcache_block_size=16,\n"
               "          max_model_len=128)\n"
               "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)\n"
               "print('transformers' in sys.modules)\n", str(bare))
    assert out.split() == ["False"]


def test_only_the_tokenizer_thread_imports_transformers(checkpoints):
    out = _run("import sys, threading\n"
               "threads = set()\n"
               "class Spy:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'transformers':\n"
               "            threads.add(threading.current_thread().name)\n"
               "sys.meta_path.insert(0, Spy())\n"
               "from nanovllm import LLM, SamplingParams\n"
               "llm = LLM(sys.argv[1], num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=128)\n"
               "print(llm.generate(['Hello world'], SamplingParams(max_tokens=2), use_tqdm=False)[0]['token_ids'])\n"
               "print(*sorted(threads))\n", checkpoints["qwen3"])
    assert out.splitlines()[-1] == "nanovllm-tokenizer"


def test_a_start_that_fails_while_loading_leaves_the_next_one_its_tokenizer(tmp_path, checkpoints):
    """LLM(...) refused while loading weights (a checkpoint lacking a tensor), then LLM(...) again in the same fresh
    process: the failed start's tokenizer thread, still importing transformers, made the second's import of
    AutoTokenizer fail (ImportError: cannot import name 'AutoTokenizer')."""
    from safetensors.torch import load_file, save_file
    broken = shutil.copytree(checkpoints["qwen3"], tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("layers.1.mlp.down_proj.weight")},
              broken / "model.safetensors")
    out = _run("import sys\n"
               "from nanovllm import LLM, SamplingParams\n"
               "try:\n"
               "    LLM(sys.argv[1], num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=128)\n"
               "except ValueError as e:\n"
               "    print('refused:', 'lacks weights' in str(e))\n"
               "llm = LLM(sys.argv[2], num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=128)\n"
               "print(len(llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)[0]['token_ids']))\n",
               str(broken), checkpoints["qwen3"])
    assert out.split() == ["refused:", "True", "2"]


# ---- (d) pickling ----------------------------------------------------------------------------------------

def test_plain_config_pickles(checkpoints):
    config = Config(checkpoints["qwen3_bias_untied"])
    assert isinstance(config.hf_config, PlainConfig)
    for copied in (pickle.loads(pickle.dumps(config.hf_config)), copy.deepcopy(config.hf_config),
                   pickle.loads(pickle.dumps(config)).hf_config):  # a whole Config travels to replicas and workers
        assert isinstance(copied, PlainConfig) and engine_view(copied) == engine_view(config.hf_config)
