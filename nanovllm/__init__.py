"""nanovllm: a small, fast offline LLM inference engine, with vLLM's offline API."""
import logging

from nanovllm.engine_args import EngineArgs
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.lora.request import LoRARequest
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling.structured_outputs import StructuredOutputsParams
from nanovllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from nanovllm.vllm_engine import LLMEngine

logging.getLogger("nanovllm").addHandler(logging.NullHandler())

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "TextPrompt", "TokensPrompt",
           "RequestOutput", "CompletionOutput", "LoRARequest", "LLMEngine", "EngineArgs", "RequestOutputKind"]
__version__ = "0.1.0"
