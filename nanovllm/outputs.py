"""What generate returns, in vLLM's shapes: RequestOutput, CompletionOutput, Logprob. They also read like the dicts
nano-vllm's scripts index (`out["text"]`, `out["outputs"][0]["token_ids"]`), so those keep running."""
import contextlib
import gc
import threading
from collections.abc import Sequence
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


@dataclass(eq=False)
class FlatLogprobs(Sequence):
    """vLLM's FlatLogprobs, what `SamplingParams(flat_logprobs=True)` returns as `logprobs` and `prompt_logprobs`:
    every position's entries in flat lists, read as the list of {token id: Logprob} dicts (None for a position
    without, as the prompt's first) it stands for, each dict made when its position is read. A scoring job's
    prompt_logprobs are millions of entries: as dicts of Logprobs, millions of objects to make and for the garbage
    collector to walk; here a handful of lists."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # position i holds entries starts[i]:ends[i]; -1: None
    ends: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            out = FlatLogprobs()
            for j in range(*i.indices(len(self))):
                out.append(self[j])
            return out
        start, end = self.starts[i], self.ends[i]
        if start < 0:
            return None
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], self.decoded_tokens[j])
                for j in range(start, end)}

    def __eq__(self, other) -> bool:  # (as the list of dicts it stands for)
        return isinstance(other, (FlatLogprobs, list)) and list(self) == list(other)

    def append(self, entries: dict | None) -> None:
        """One more position: {token id: Logprob or float}, or None."""
        if entries is None:
            self.starts.append(-1)
            self.ends.append(-1)
            return
        self.starts.append(len(self.token_ids))
        for token, value in entries.items():
            self.token_ids.append(token)
            self.logprobs.append(float(value))
            self.ranks.append(getattr(value, "rank", None))
            self.decoded_tokens.append(getattr(value, "decoded_token", None))
        self.ends.append(len(self.token_ids))

    def extend(self, positions) -> None:
        if not isinstance(positions, FlatLogprobs):
            for entries in positions:
                self.append(entries)
            return
        offset = len(self.token_ids)
        self.starts += [s + offset if s >= 0 else -1 for s in positions.starts]
        self.ends += [e + offset if e >= 0 else -1 for e in positions.ends]
        self.token_ids += positions.token_ids
        self.logprobs += positions.logprobs
        self.ranks += positions.ranks
        self.decoded_tokens += positions.decoded_tokens

    def copy(self) -> "FlatLogprobs":
        return FlatLogprobs(*(list(values) for values in (self.token_ids, self.logprobs, self.ranks,
                                                          self.decoded_tokens, self.starts, self.ends)))


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

