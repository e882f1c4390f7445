import os
from dataclasses import dataclass, field

import xxhash


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive integer id that names it in the engine, and its PEFT directory
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not os.fspath(self.lora_path):
            raise ValueError(f"lora_path must be the adapter's directory, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def cache_salt(request: LoRARequest | None, generation: int = 0) -> int:
    """What the prefix cache chains a sequence's first block onto: -1 for the base model, else a value of the
    adapter's id, path and registration (lora/manager.py), so that blocks are never shared between adapters, nor
    with an adapter removed and added again."""
    if request is None:
        return -1
    return xxhash.xxh64(f"{request.lora_int_id}:{request.lora_path}:{generation}".encode()).intdigest() >> 1
