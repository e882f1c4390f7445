import os

import pytest
import torch

from tests.tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_tied"), "qwen3", tie=True, num_kv_heads=2)


@pytest.fixture(scope="session")
def qwen3_untied_mha(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_mha"), "qwen3", tie=False, num_kv_heads=4)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
