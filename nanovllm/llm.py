from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The user-facing entry point: `LLM(model_path, **options).generate(prompts, sampling_params)`."""

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc):
        self.exit()
