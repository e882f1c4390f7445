"""LoRA adapters over one base model (docs/lora.md): vLLM's LoRARequest, PEFT's adapter format."""
from nanovllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
