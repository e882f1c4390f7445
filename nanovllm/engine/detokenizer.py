class IncrementalDetokenizer:
    """Text of a growing list of token ids, one delta at a time.

    Decodes only a short window (prefix_offset..end) per call. A delta is released only when it does
    not end in U+FFFD, so a multi-byte character split over several tokens comes out whole."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # (only where set: tokenizers that lack it may refuse the keyword)
            self.options["spaces_between_special_tokens"] = False
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are already text
        self.read_offset = 0  # tokens before it are in self.text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.options) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def _longest(stops: list[str]) -> int:
    return max(map(len, stops), default=0)


def find_stop(text: str, delta_len: int, stops: list[str]) -> tuple[int, str] | None:
    """(where the first stop string starts in `text`, that string), looking only where one could have been completed
    by the last `delta_len` characters; None if none is there."""
    window_start = max(0, len(text) - delta_len - _longest(stops) + 1)
    hits = [(i, stop) for stop in stops if (i := text.find(stop, window_start)) >= 0]
    return min(hits) if hits else None


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of an unfinished text to hold back: they could still begin a stop string."""
    return min(len(text), max(0, _longest(stops) - 1))
