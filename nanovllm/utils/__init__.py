"""vLLM's utilities that its offline examples import: FlexibleArgumentParser (also as
nanovllm.utils.argparse_utils.FlexibleArgumentParser, vLLM's newer path)."""
from nanovllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
