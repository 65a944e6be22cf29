"""Incremental detokenization with stop strings that are never emitted, not even in part
(unless asked to keep the one that ends the text)."""

from __future__ import annotations

from radixd.core.hf_names import hf_names

CONTEXT_TOKENS = 4  # prompt tokens decoded ahead of the output so word-initial spaces survive


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool, stop: list[str],
                 keep_stop: bool = False):
        self.tok = tokenizer
        self.keep_stop = keep_stop  # emit the stop string that ends the text (then nothing more)
        self.skip = skip_special_tokens
        self._backend = _backend_decoder(tokenizer)
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""          # decoded output text so far
        self.emitted = 0        # characters of ``text`` handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended for another reason: hand out what was held back.

        Tokens still pending because they end inside a UTF-8 character are decoded as they
        are (with replacement characters): the stream then ends with the same text as
        decoding all output tokens at once, instead of silently dropping their bytes.
        """
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix):
                self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stop:
            start = max(0, self.emitted - self.max_stop + 1)
            hits = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, minus_len = min(hits)  # the first stop string, the longest one there
                self.matched = self.text[cut : cut - minus_len]
                if self.keep_stop:
                    cut -= minus_len
                out = self.text[self.emitted : cut]
                self.text = self.text[:cut]
                self.emitted = cut
                self.stopped = True
                return out
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that could still grow into a stop string."""
        tail = self.text[-self.max_stop :] if self.max_stop else ""
        for n in range(min(len(tail), self.max_stop - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0


def _backend_decoder(tokenizer):
    """The ``tokenizers`` decoder behind a fast tokenizer whose ``decode`` (without clean-up)
    is just that call, else None. It skips transformers' per-call argument handling, which
    costs more than the decoding itself; two decodes run per generated token."""
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
    return backend.decode
