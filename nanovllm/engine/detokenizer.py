CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the completion (vLLM's initial detokenization offset)
MAX_CONTEXT_TOKENS = 24  # prompt tokens searched for a context that starts on a whole character (text_context)


def text_context(tokenizer, tail: list[int], **options) -> list[int]:
    """The prompt tokens decoded ahead of a completion: the shortest suffix of `tail` (the prompt's last tokens), of
    CONTEXT_TOKENS at least, whose text holds no U+FFFD, as vLLM's fast detokenizer picks it. A context that starts
    inside a character garbles more than itself: a byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes a run
    of byte tokens that is not valid UTF-8 as all U+FFFD, the completion's first bytes included. Without such a
    suffix: the last CONTEXT_TOKENS, or none where they end inside a character (the completion decodes alone)."""
    tail = list(tail)
    for n in range(min(CONTEXT_TOKENS, len(tail)), len(tail) + 1):
        if "\ufffd" not in tokenizer.decode(tail[-n:], **options):
            return tail[-n:]
    context = tail[-CONTEXT_TOKENS:]
    return [] if context and tokenizer.decode(context, **options).endswith("\ufffd") else context


class IncrementalDetokenizer:
    """Text of a growing list of token ids, one delta at a time.

    Decodes only a short window (prefix_offset..end) per call. A delta is released only when it does
    not end in U+FFFD, so a multi-byte character split over several tokens comes out whole. `context`: the prompt's
    last tokens (text_context picks where to start), decoded ahead of the completion and never part of its text, so
    that the first token's text is what it is after the prompt (SentencePiece tokenizers drop a word's leading space
    at the start of a decode)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 context: list[int] = ()):
        self.tokenizer = tokenizer
        self.options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # (only where set: tokenizers that lack it may refuse the keyword)
            self.options["spaces_between_special_tokens"] = False
        self.ids = text_context(tokenizer, context, **self.options)  # the context, then the completion
        self.token_ids: list[int] = []  # the completion's tokens
        self.prefix_offset = 0  # window start: tokens before it are already text
        self.read_offset = len(self.ids)  # tokens before it are in self.text (or the context)
        self.text = ""
        self.searched = 0  # characters of text before which no stop string can newly end (_update_text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.options) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be empty)."""
        self.ids.append(token_id)
        self.token_ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if not full.startswith(prefix):  # (a byte-fallback decoder: below) the held-back tokens alone
            full = prefix + self._decode(self.ids[self.read_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def decode_after(tokenizer, context: list[int], ids: list[int], **options) -> str:
    """The text of `ids` as it reads after `context` (the prompt's last tokens): IncrementalDetokenizer's text in one
    go, for outputs that were not detokenized while generating."""
    if not ids:
        return ""
    context = text_context(tokenizer, context, **options)
    text = _decode_after(tokenizer, context, ids, options)
    if text.endswith("\ufffd"):
        # It may end inside a character (a length cut), which a byte-fallback decoder (Llama 2, Mistral, Gemma) turns
        # into U+FFFD with the whole run of byte tokens before it, whole characters too: as flush() reads it, the
        # text up to the last token that ends a character, then the tokens after it alone (a character's bytes are
        # 4 tokens at most).
        for held in range(1, min(len(ids), 4)):
            head = _decode_after(tokenizer, context, ids[:-held], options)
            if not head.endswith("\ufffd"):
                return head + tokenizer.decode(ids[-held:], **options)
    return text


def _decode_after(tokenizer, context: list[int], ids: list[int], options: dict) -> str:
    if context:
        before = tokenizer.decode(context, **options)
        full = tokenizer.decode(list(context) + list(ids), **options)
        if full.startswith(before):  # (else the context ends inside a character: decode the ids alone)
            return full[len(before):]
    return tokenizer.decode(ids, **options)


def _longest(stops: list[str]) -> int:
    return max(map(len, stops), default=0)


def find_stop(text: str, delta_len: int, stops: list[str]) -> tuple[int, str] | None:
    """(where the stop string starts in `text`, that string) for the first string of `stops` found there, looking only
    at occurrences that end in the last `delta_len` characters (vLLM's check_stop_strings: list order decides when
    one step's text completes several); None if none is."""
    new_from = len(text) - delta_len
    for stop in stops:
        i = text.find(stop, max(0, new_from - len(stop) + 1))
        if i >= 0:
            return i, stop
    return None


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of an unfinished text to hold back: they could still begin a stop string."""
    return min(len(text), max(0, _longest(stops) - 1))
