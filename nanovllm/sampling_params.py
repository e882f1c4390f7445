from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Per-request generation options. temperature 0 means greedy."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not self.temperature >= 0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.temperature = float(self.temperature)
