"""nanovllm: a small, fast offline LLM inference engine."""
import logging

from nanovllm.llm import LLM
from nanovllm.sampling.structured_outputs import StructuredOutputsParams
from nanovllm.sampling_params import SamplingParams

logging.getLogger("nanovllm").addHandler(logging.NullHandler())

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
