"""The vocabulary as byte strings, laid out for vectorized walks through a DFA."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from radixd.core.detokenizer import byte_alphabet


class TokenizerInfo:
    """What a grammar needs of a tokenizer: each token id's bytes (None for special tokens,
    which no grammar emits), the model's vocabulary size (the logits' width, which may exceed
    the tokenizer's) and the EOS ids (allowed only where the grammar accepts). ``special``:
    the text of each special token (``<|python_tag|>``), which free text may contain and
    triggers may be (``triggers``), though no grammar emits it.

    ``key`` identifies the vocabulary (compiled grammars are cached per key)."""

    def __init__(self, token_bytes: list[bytes | None], vocab_size: int, eos_ids: tuple[int, ...],
                 special: dict[int, bytes] | None = None):
        self.vocab_size = vocab_size
        self.token_bytes = list(token_bytes[:vocab_size]) + [None] * max(0, vocab_size - len(token_bytes))
        self.eos_ids = tuple(t for t in eos_ids if 0 <= t < vocab_size)
        self.special = {t: b for t, b in sorted((special or {}).items()) if 0 <= t < vocab_size}
        h = hashlib.sha1(repr((vocab_size, self.eos_ids, self.special)).encode())
        for b in self.token_bytes:
            h.update(b"\xff\xfe" if b is None else b + b"\xff")
        self.key = h.hexdigest()
        # Rows are token ids (the whole vocabulary): a padded byte matrix, lengths (0 for
        # tokens without bytes) and the token trie.
        self.lengths = np.array([len(b) if b else 0 for b in self.token_bytes], dtype=np.int64)
        self.has_bytes = self.lengths > 0
        width = int(self.lengths.max()) if vocab_size else 0
        mat = np.zeros((vocab_size, max(width, 1)), dtype=np.int64)
        for i, b in enumerate(self.token_bytes):
            if b:
                mat[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        self.bytes_matrix = mat
        self.first_byte = mat[:, 0].copy()  # (0 for tokens without bytes: mask with has_bytes)
        self.trie = _Trie([b or b"" for b in self.token_bytes])

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, eos_ids: tuple[int, ...] = ()) -> TokenizerInfo:
        """From a Hugging Face tokenizer (byte-level BPE, or SentencePiece-style ``▁``/<0xNN>)."""
        n = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                special.add(tid)
        dec = byte_alphabet()
        byte_level = all(p is None or all(ch in dec for ch in p) for p in pieces[: min(n, 5000)]
                         if p is not None and p not in ("",))
        out: list[bytes | None] = []
        texts: dict[int, bytes] = {}
        for tid, p in enumerate(pieces):
            if p is None or tid in special:
                out.append(None)
                if p:
                    texts[tid] = p.encode()
            elif byte_level and all(ch in dec for ch in p):
                out.append(bytes(dec[ch] for ch in p))
            elif p.startswith("<0x") and p.endswith(">") and len(p) == 6:
                out.append(bytes([int(p[3:5], 16)]))
            else:
                out.append(p.replace("▁", " ").encode())
        eos = tuple(eos_ids) or tuple(t for t in [getattr(tokenizer, "eos_token_id", None)] if t is not None)
        return cls(out, vocab_size or n, eos, texts)


class _Trie:
    """The tokens' byte strings as a trie numbered level by level (breadth first), so a DFA
    walk of the whole vocabulary is one gather per level over that level's nodes, and shared
    prefixes are walked once. ``end[row]``: the node where token ``row`` ends."""

    def __init__(self, tokens: list[bytes]):
        root: dict = {}
        for b in tokens:
            node = root
            for c in b:
                nxt = node.get(c)
                if nxt is None:
                    nxt = node[c] = {}
                node = nxt
        parent, byte, levels = [0], [0], [0, 1]
        ids = {id(root): 0}
        frontier = [root]
        while frontier:
            nxt_frontier = []
            for node in frontier:
                pid = ids[id(node)]
                for c, child in node.items():
                    ids[id(child)] = len(parent)
                    parent.append(pid)
                    byte.append(c)
                    nxt_frontier.append(child)
            frontier = nxt_frontier
            if frontier:
                levels.append(len(parent))
        self.parent = np.array(parent, dtype=np.int64)
        # children of a node are contiguous (breadth-first numbering)
        self.child_count = np.bincount(self.parent[1:], minlength=len(parent)).astype(np.int64)
        first = np.full(len(parent), len(parent), dtype=np.int64)
        np.minimum.at(first, self.parent[1:], np.arange(1, len(parent)))
        self.child_start = first
        self.byte = np.array(byte, dtype=np.int64)
        self.levels = levels  # nodes of depth d: [levels[d], levels[d + 1])
        self.depth = np.zeros(len(parent), dtype=np.int64)
        for d in range(1, len(levels) - 1):
            self.depth[levels[d]:levels[d + 1]] = d
        end = []
        for b in tokens:
            node = root
            for c in b:
                node = node[c]
            end.append(ids[id(node)])
        self.end = np.array(end, dtype=np.int64)
        self.size = len(parent)
        # Tokens under each node: ``order[lo[n]:hi[n]]`` (tokens sorted by their end node's
        # depth-first position; a subtree is a contiguous range of those positions).
        pre = np.zeros(self.size, dtype=np.int64)
        span = np.ones(self.size, dtype=np.int64)
        children: list[list[int]] = [[] for _ in range(self.size)]
        for n in range(1, self.size):
            children[parent[n]].append(n)
        stack, counter, post = [0], 0, []
        while stack:
            n = stack.pop()
            pre[n] = counter
            counter += 1
            post.append(n)
            stack.extend(reversed(children[n]))
        for n in reversed(post):  # children before parents
            if n:
                span[parent[n]] += span[n]
        tok_pre = pre[self.end]
        self.order = np.argsort(tok_pre, kind="stable")
        sorted_pre = tok_pre[self.order]
        self.lo = np.searchsorted(sorted_pre, pre, side="left")
        self.hi = np.searchsorted(sorted_pre, pre + span, side="left")
        # tokens ending exactly at node n: ``order[lo[n]:lo[n] + exact[n]]`` (a node comes
        # before its descendants in depth-first order); none at the root (empty tokens)
        self.exact = np.bincount(self.end, minlength=self.size).astype(np.int64)
        self.exact[0] = 0
        # the same as Python lists, for walks of a few nodes (faster than numpy calls there)
        self.lists = _TrieLists(self.child_start.tolist(), self.child_count.tolist(), self.byte.tolist(),
                                self.exact.tolist(), self.lo.tolist(), self.order.tolist())


class _TrieLists(NamedTuple):
    child_start: list[int]
    child_count: list[int]
    byte: list[int]
    exact: list[int]
    lo: list[int]
    order: list[int]


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorized."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - np.cumsum(counts) + counts, counts)
