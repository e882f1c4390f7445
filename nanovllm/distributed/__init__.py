"""Tensor-parallel ranks, data-parallel replicas and their executors; and vLLM's cleanup_dist_env_and_memory, which
its scripts call between two LLMs in one process."""
import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's (vllm.distributed): after `del llm`, hand the memory back before the next LLM starts. An LLM's worker
    processes and process group stop when its last reference goes (or at llm.exit()); this collects what reference
    cycles still hold, so that an LLM dropped inside one goes too, and empties the CUDA cache. shutdown_ray: also
    ray.shutdown(), where Ray was started."""
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ray = sys.modules.get("ray")  # (a script that never imported Ray has none to shut down)
    if shutdown_ray and ray is not None and ray.is_initialized():
        ray.shutdown()
