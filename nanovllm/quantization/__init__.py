"""Quantized weights (docs/quantization.md): FP8 checkpoints (Qwen's block-scaled format, compressed-tensors'
float-quantized format) and fp8 for any checkpoint (quantization="fp8"). config.py reads and checks a checkpoint's
quantization_config; fp8.py is the linear layers' quant method (weights, their loading, the product)."""
from nanovllm.quantization.config import QUANTIZATION_METHODS, QuantConfig, quant_config

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "quant_config"]
