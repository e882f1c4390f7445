import weakref

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the completion (vLLM's initial detokenization offset)
MAX_CONTEXT_TOKENS = 24  # prompt tokens searched for a context that starts on a whole character (text_context)


def text_context(tokenizer, tail: list[int], **options) -> list[int]:
    """The prompt tokens decoded ahead of a completion: the shortest suffix of `tail` (the prompt's last tokens), of
    CONTEXT_TOKENS at least, whose text holds no U+FFFD (it starts on a whole character), as vLLM's fast detokenizer
    picks it. Without such a suffix: the last CONTEXT_TOKENS, or none where they end inside a character (the
    completion decodes alone)."""
    tail = list(tail)
    for n in range(min(CONTEXT_TOKENS, len(tail)), len(tail) + 1):
        if "\ufffd" not in tokenizer.decode(tail[-n:], **options):
            return tail[-n:]
    context = tail[-CONTEXT_TOKENS:]
    return [] if context and tokenizer.decode(context, **options).endswith("\ufffd") else context


def decode(tokenizer, ids: list[int], **options) -> str:
    """tokenizer.decode(ids), where a byte-fallback tokenizer's (Llama 2, Mistral, Gemma) run of <0xNN> byte tokens
    that is not valid UTF-8 reads as SentencePiece decodes it: its whole characters as they are and each byte that is
    no part of one as U+FFFD. (Hugging Face's ByteFallback decoder turns every byte of such a run into U+FFFD, so the
    text of a valid character would depend on the bytes after it and on where a decode starts: streams and
    generate's one decode read the same tokens differently.) Any valid-UTF-8 output decodes as tokenizer.decode."""
    return _whole_characters(tokenizer, ids, tokenizer.decode(ids, **options), options)


def _whole_characters(tokenizer, ids: list[int], text: str, options: dict) -> str:
    """decode's text of `ids`, given `text`, their tokenizer.decode."""
    if "\ufffd" in text:  # (an invalid run always shows as U+FFFD: only then look further)
        table = _byte_tokens(tokenizer)
        if table is not None:
            if options.get("skip_special_tokens"):  # (dropped before the decoder joins the byte tokens around them)
                ids = [token for token in ids if token not in table[2]]
            text = tokenizer.decode(_valid_utf8(ids, table[0], table[1]), **options)
    return text


_BYTE_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> _byte_tokens' answer
_INVALID_BYTES = {0xDC00 + b: "\ufffd" for b in range(0x80, 0x100)}  # surrogateescape's characters -> U+FFFD


def _byte_tokens(tokenizer) -> tuple[dict[int, int], list[int], set[int]] | None:
    """A byte-fallback tokenizer's <0x00>..<0xFF> tokens as ({id: byte}, [id of each byte], its special tokens' ids);
    None for other tokenizers."""
    if tokenizer in _BYTE_TOKENS:
        return _BYTE_TOKENS[tokenizer]
    names = [f"<0x{byte:02X}>" for byte in range(256)]
    ids = tokenizer.convert_tokens_to_ids(names)
    table = None
    if None not in ids and tokenizer.convert_ids_to_tokens(ids) == names:
        table = {token: byte for byte, token in enumerate(ids)}, ids, set(tokenizer.all_special_ids)
    _BYTE_TOKENS[tokenizer] = table
    return table


def _valid_utf8(ids: list[int], byte_of: dict[int, int], id_of: list[int]) -> list[int]:
    """`ids` with each byte of a run of byte tokens that is no part of a whole character replaced by the byte tokens
    of U+FFFD (EF BF BD), so that every run is valid UTF-8."""
    out, run = [], bytearray()
    for token in ids:
        byte = byte_of.get(token)
        if byte is not None:
            run.append(byte)
            continue
        if run:
            out += _run_tokens(run, id_of)
            run.clear()
        out.append(token)
    if run:
        out += _run_tokens(run, id_of)
    return out


def _run_tokens(run: bytearray, id_of: list[int]) -> list[int]:
    fixed = run.decode("utf-8", "surrogateescape").translate(_INVALID_BYTES).encode()
    return [id_of[byte] for byte in fixed]


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
        return decode(self.tokenizer, ids, **self.options) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be empty)."""
        self.ids.append(token_id)
        self.token_ids.append(token_id)
        window = self.ids[self.prefix_offset :]
        full = self.tokenizer.decode(window, **self.options)
        if full.endswith("\ufffd"):  # it may end inside a character: held back (flush releases what is left)
            return ""
        full = _whole_characters(self.tokenizer, window, full, self.options)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(full) > len(prefix):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
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
    if context:
        before = decode(tokenizer, context, **options)
        full = decode(tokenizer, list(context) + list(ids), **options)
        if full.startswith(before):  # (else the context ends inside a character: decode the ids alone)
            return full[len(before):]
    return decode(tokenizer, ids, **options)


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


def stop_holdback(text: str, stops: list[str], include_stop_str_in_output: bool = False) -> int:
    """How many trailing characters of an unfinished text to hold back: they could still begin a stop string, which
    the text would leave out. Nothing with include_stop_str_in_output (vLLM's stop_buffer_length): the text then keeps
    everything up to a stop string's end, so nothing shown can be taken back."""
    if include_stop_str_in_output:
        return 0
    return min(len(text), max(0, _longest(stops) - 1))
