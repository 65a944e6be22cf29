"""Incremental detokenization with stop strings that are never emitted, not even in part
(unless asked to keep the one that ends the text).

Two ways to turn a request's tokens into text, chosen once per tokenizer by ``Detokenizers``:

- byte-level BPE (GPT-2's byte alphabet: Llama 3, Qwen, SmolLM2, DeepSeek, ...): each token
  is a fixed byte string, so a table of them, built once, and an incremental UTF-8 decoder
  give the text at about a seventh of the cost. The text is exactly ``tokenizer.decode`` of
  the output tokens; a self-check against it at build time turns the table off otherwise.
- any other tokenizer: two decodes per token over a sliding window of ids (the prompt's
  last tokens ahead of the output, so word-initial spaces survive), as vLLM and SGLang do.
"""

from __future__ import annotations

import codecs
import functools
import logging

from radixd.core.hf_names import hf_names

log = logging.getLogger("radixd.engine")

CONTEXT_TOKENS = 4  # prompt tokens decoded ahead of the output so word-initial spaces survive


class TextStream:
    """The text decoded and not yet handed out, and the stop strings: what part of it may be
    handed out now.

    ``text`` keeps only what is not handed out yet plus, with stop strings, the last
    ``max_stop - 1`` characters that were (a stop string may begin in them): a long output
    is not copied again with every token. Subclasses append to ``text`` in ``add`` /
    ``finish`` and return ``_release``'s result."""

    def __init__(self, stop: list[str], keep_stop: bool):
        self.keep_stop = keep_stop  # emit the stop string that ends the text (then nothing more)
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.text = ""          # the tail of the decoded text (see above)
        self.emitted = 0        # characters of ``text`` handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        raise NotImplementedError

    def finish(self) -> str:
        """The request ended for another reason: hand out what was held back."""
        raise NotImplementedError

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.text
        if not self.stop:
            self.text = ""
            return text
        start = max(0, self.emitted - self.max_stop + 1)
        hits = [(i, -len(s)) for s in self.stop if (i := text.find(s, start)) >= 0]
        if hits:
            cut, minus_len = min(hits)  # the first stop string, the longest one there
            self.matched = text[cut : cut - minus_len]
            if self.keep_stop:
                cut -= minus_len
            out = text[self.emitted : cut]
            self.text = text[:cut]
            self.emitted = cut
            self.stopped = True
            return out
        end = len(text) if final else len(text) - self._held_back()
        out = text[self.emitted : end]
        end = max(self.emitted, end)
        drop = max(0, end - self.max_stop + 1)
        self.text = text[drop:]
        self.emitted = end - drop
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that could still grow into a stop string."""
        tail = self.text[-self.max_stop :] if self.max_stop else ""
        for n in range(min(len(tail), self.max_stop - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0


class IncrementalDetokenizer(TextStream):
    """Any tokenizer: two decodes per token over the ids from ``prefix_offset`` on."""

    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool, stop: list[str],
                 keep_stop: bool = False):
        super().__init__(stop, keep_stop)
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # the backend's decode skips transformers' per-call argument handling, which costs more
        # than the decoding itself (two decodes run per generated token)
        backend = _fast_backend(tokenizer)
        self._backend = None if backend is None else backend.decode
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Tokens still pending because they end inside a UTF-8 character are decoded as they
        are (with replacement characters): the stream then ends with the same text as
        decoding all output tokens at once, instead of silently dropping their bytes."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix):
                self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._release(final=True)


class ByteLevelDetokenizer(TextStream):
    """A byte-level BPE tokenizer: each token's bytes from a table, through an incremental
    UTF-8 decoder (bytes of an unfinished character wait; invalid ones become U+FFFD as
    ``tokenizer.decode`` writes them)."""

    def __init__(self, table: tuple[bytes, ...], *, stop: list[str], keep_stop: bool = False):
        super().__init__(stop, keep_stop)
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        table = self._table
        piece = self._utf8.decode(table[token] if token < len(table) else b"")
        if not self.stop:
            return piece  # nothing to hold back or search: the hot path, per token
        self.text += piece
        return self._release(final=False)

    def finish(self) -> str:
        """Bytes of an unfinished character are handed out as U+FFFD, as decoding all output
        tokens at once writes them."""
        if not self.stopped:
            self.text += self._utf8.decode(b"", True)
        return self._release(final=True)


class Detokenizers:
    """Makes each request's detokenizer for one tokenizer (the byte table is built here, once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._tables = byte_tables(tokenizer)

    @property
    def byte_level(self) -> bool:
        return self._tables is not None

    def new(self, prompt_ids: list[int], *, skip_special_tokens: bool, stop: list[str],
            keep_stop: bool = False) -> TextStream:
        if self._tables is not None:
            return ByteLevelDetokenizer(self._tables[skip_special_tokens], stop=stop, keep_stop=keep_stop)
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens,
                                      stop=stop, keep_stop=keep_stop)


def _fast_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer whose ``decode`` (without
    clean-up) is just that object's ``decode``, else None."""
    try:
        (PreTrainedTokenizerFast,) = hf_names("PreTrainedTokenizerFast")
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    base = getattr(PreTrainedTokenizerFast, "_decode", None)
    if backend is None or base is None or getattr(type(tokenizer), "_decode", None) is not base:
        return None
    if type(tokenizer).decode is not PreTrainedTokenizerFast.decode:
        return None
    return backend


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character each byte is written as in
    the vocabulary -> the byte. Printable bytes stand for themselves; the other 68 (control
    characters, space, 0x7f-0xa0, 0xad) take the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for k, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + k)
    return {c: b for b, c in chars.items()}


def byte_tables(tokenizer) -> dict[bool, tuple[bytes, ...]] | None:
    """For a tokenizer whose decoder is ``tokenizers``' ByteLevel alone: each id's bytes, for
    ``skip_special_tokens`` False and True. ByteLevel decodes a token (added ones too) through
    the alphabet when every character is in it, else as its own UTF-8, then the whole
    byte string as UTF-8 with U+FFFD for what is invalid. None for any other tokenizer, or
    when a sample decoded both ways differs."""
    backend = _fast_backend(tokenizer)
    if backend is None:
        return None
    from tokenizers import decoders

    if type(backend.decoder) is not decoders.ByteLevel:
        return None
    alphabet = byte_alphabet()
    added = backend.get_added_tokens_decoder()
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    full: list[bytes] = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            full.append(b"")
            continue
        try:
            full.append(bytes([alphabet[c] for c in token]))
        except KeyError:
            full.append(token.encode())
    skipped = list(full)
    for i, t in added.items():
        if t.special:
            skipped[i] = b""
    tables = {False: tuple(full), True: tuple(skipped)}
    sample = [*range(0, size, max(1, size // 997)), *sorted(added), *range(max(0, size - 64), size)]
    for skip, table in tables.items():
        want = backend.decode(sample, skip_special_tokens=skip)
        if b"".join(table[i] for i in sample).decode("utf-8", "replace") != want:
            log.info("byte-level detokenizer off: its table disagrees with the tokenizer's decode")
            return None
    return tables
