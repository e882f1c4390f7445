from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.frontend import Frontend


class LLM(Frontend, LLMEngine):
    """The user-facing entry point: `LLM(model_path, **options).generate(prompts, sampling_params)`.

    With data_parallel_size=N > 1 it returns a DataParallelLLM instead: N replicas of this engine in spawned
    processes behind the same generate / stream / chat / exit (nanovllm/distributed/data_parallel.py)."""

    def __new__(cls, model=None, **kwargs):
        dp = kwargs.get("data_parallel_size", 1)
        if isinstance(dp, int) and not isinstance(dp, bool) and dp > 1:
            from nanovllm.distributed.data_parallel import DataParallelLLM
            return DataParallelLLM(model, **kwargs)
        return super().__new__(cls)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc):
        self.exit()
