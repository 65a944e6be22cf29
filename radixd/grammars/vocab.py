"""The vocabulary as byte strings, laid out for vectorized walks through a DFA."""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenizerInfo:
    """What a grammar needs of a tokenizer: each token id's bytes (None for special tokens,
    which no grammar emits), the model's vocabulary size (the logits' width, which may exceed
    the tokenizer's) and the EOS ids (allowed only where the grammar accepts).

    ``key`` identifies the vocabulary (compiled grammars are cached per key)."""

    def __init__(self, token_bytes: list[bytes | None], vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.token_bytes = list(token_bytes[:vocab_size]) + [None] * max(0, vocab_size - len(token_bytes))
        self.eos_ids = tuple(t for t in eos_ids if 0 <= t < vocab_size)
        h = hashlib.sha1(repr((vocab_size, self.eos_ids)).encode())
        for b in self.token_bytes:
            h.update(b"\xff\xfe" if b is None else b + b"\xff")
        self.key = h.hexdigest()
        # Tokens with bytes, longest last; a padded byte matrix in that order.
        ids = [i for i, b in enumerate(self.token_bytes) if b]
        ids.sort(key=lambda i: len(self.token_bytes[i]))
        self.ids = np.array(ids, dtype=np.int64)
        self.lengths = np.array([len(self.token_bytes[i]) for i in ids], dtype=np.int64)
        width = int(self.lengths.max()) if ids else 0
        mat = np.zeros((len(ids), max(width, 1)), dtype=np.int64)
        for row, i in enumerate(ids):
            b = self.token_bytes[i]
            mat[row, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        self.bytes_matrix = mat
        # first row index whose token is longer than j, for each j
        self.longer_than = np.searchsorted(self.lengths, np.arange(width + 1), side="right")

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, eos_ids: tuple[int, ...] = ()) -> TokenizerInfo:
        """From a Hugging Face tokenizer (byte-level BPE, or SentencePiece-style ``▁``/<0xNN>)."""
        n = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                special.add(tid)
        dec = _byte_decoder()
        byte_level = all(p is None or all(ch in dec for ch in p) for p in pieces[: min(n, 5000)]
                         if p is not None and p not in ("",))
        out: list[bytes | None] = []
        for tid, p in enumerate(pieces):
            if p is None or tid in special:
                out.append(None)
            elif byte_level and all(ch in dec for ch in p):
                out.append(bytes(dec[ch] for ch in p))
            elif p.startswith("<0x") and p.endswith(">") and len(p) == 6:
                out.append(bytes([int(p[3:5], 16)]))
            else:
                out.append(p.replace("▁", " ").encode())
        eos = tuple(eos_ids) or tuple(t for t in [getattr(tokenizer, "eos_token_id", None)] if t is not None)
        return cls(out, vocab_size or n, eos)
