import pytest

from nanovllm import LLM


@pytest.fixture(scope="package")
def llm(bundled):
    """The bundled SmolLM2-135M-Instruct, as a vLLM script makes it."""
    llm = LLM(model=bundled, max_model_len=1024, gpu_memory_utilization=0.9, seed=0)
    yield llm
    llm.exit()
