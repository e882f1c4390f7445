"""What generate returns, in vLLM's shapes: RequestOutput, CompletionOutput, Logprob. They also read like the dicts
nano-vllm's scripts index (`out["text"]`, `out["outputs"][0]["token_ids"]`), so those keep running."""
import contextlib
import gc
import threading
from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability, as vLLM's Logprob: `.logprob`, `.rank` (1: the most likely token), `.decoded_token`.
    It is also that float, so a logprob dict reads as {token id: float} too."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


_paused_lock = threading.Lock()
_paused = 0  # collector_paused blocks open, in every thread (the collector is one for the process)
_paused_restore = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused():
    """For building many Logprobs at once: the cyclic garbage collector paused meanwhile (as it was before, after).
    A Logprob holds its rank and text, so the collector tracks each one, and hundreds of thousands of them (a scoring
    job's prompt_logprobs) set off collections that walk the whole heap: they took two thirds of the host time of
    scoring 1,000 x 512-token prompts. Logprobs and their dicts form no cycles, so nothing is left for it to find.
    Engines in several threads share the one collector: it is paused from the first block to begin to the last to
    end (each saving and restoring it itself, one thread could read it off while another's block paused it, then
    turn it off after that block turned it back on, and leave it off for good)."""
    global _paused, _paused_restore
    with _paused_lock:
        if not _paused:
            _paused_restore = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if not _paused and _paused_restore:
                gc.enable()


class _Keys:
    """Dict-style reading of a dataclass: the keys nano-vllm's dict outputs had (those that are set)."""

    _KEYS: tuple[str, ...] = ()

    def keys(self) -> list[str]:
        return [k for k in self._KEYS if self._get(k) is not None]

    def _get(self, key: str):
        return getattr(self, key)

    def __getitem__(self, key: str):
        if key not in self._KEYS or self._get(key) is None:
            raise KeyError(key)
        return self._get(key)

    def get(self, key: str, default=None):
        return self[key] if key in self.keys() else default

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def items(self) -> list[tuple]:
        return [(k, self._get(k)) for k in self.keys()]


@dataclass
class CompletionOutput(_Keys):
    """One sample of a request (vLLM's fields). finish_reason: "stop", "length", or "error" (a structured-outputs
    constraint that no text could continue); stop_reason: the stop string or stop token id that ended it (None for
    EOS or a length). cumulative_logprob and logprobs: when SamplingParams.logprobs was set."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    _KEYS = ("text", "token_ids", "finish_reason", "logprobs")

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput(_Keys):
    """One prompt's result (vLLM's fields). prompt_logprobs: None for the first prompt token, then one dict per token,
    when SamplingParams.prompt_logprobs was set. num_cached_tokens: prompt tokens the prefix cache served. As a dict
    it reads as nano-vllm's did: its first sample's text, token_ids, finish_reason and logprobs at the top level."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: object = field(default=None, repr=False)
    lora_request: object = field(default=None, repr=False)

    _KEYS = ("text", "token_ids", "finish_reason", "logprobs", "prompt_token_ids", "num_cached_tokens", "outputs",
             "prompt_logprobs")
    _FIRST = ("text", "token_ids", "finish_reason", "logprobs")

    def _get(self, key: str):
        return getattr(self.outputs[0], key) if key in self._FIRST else getattr(self, key)

