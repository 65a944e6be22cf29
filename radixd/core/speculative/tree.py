"""Token trees: a drafter's several guesses at once, verified in one target forward.

Contract
--------
* A ``TokenTree`` is the list of its drafted nodes' tokens with ``parents``: node i follows
  node ``parents[i]`` (-1: the root, the request's last token), and every parent comes before
  its children; a chain is the tree whose parents are ``-1, 0, 1, ...``, and the speculator
  sends such a tree on as a plain list (``as_draft``), so chains verify exactly as before.
  Node i's first child in order is its preferred continuation (a chain drafter's choice).
* In the verify step a tree of n nodes is n + 1 decode rows of the request's table row, in
  node order after the root, at table positions ``P .. P + n`` (P: the root's), so its KV
  slots are consecutive as a chain's; each row's RoPE position is ``P + depth`` and its query
  sees the prefix, its ancestors and itself (``ForwardBatch.trees``, the mask ``mask``
  builds; the attention backends apply it).
* Acceptance (``walk``): from the root, follow the child whose token equals the pick at the
  node, as deep as it goes. Each node's pick is drawn with plain decoding's noise for its
  token index (the request's tokens so far plus its depth), from the target's distribution
  given its ancestors: following the child that equals it keeps a sequence exactly as
  plain decoding would draw it (greedy: its argmax). For point-proposal children this is the
  tree's recursive rejection sampling: child c is taken with probability p(c), and where none
  is, the pick is a draw from p without the children, normalised. The accepted path's KV is
  then moved into the request's consecutive slots (``KVManager.keep_path``).
"""

from __future__ import annotations

import torch


class TokenTree(list):
    """Drafted tokens in node order, with each node's parent (see the contract)."""

    def __init__(self, tokens: list[int], parents: list[int]):
        super().__init__(tokens)
        self.parents = parents
        depth: list[int] = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        self.depths = depth  # node i's distance from the root (its children: 1)

    def path(self, i: int) -> list[int]:
        """The nodes from the root's child down to node ``i`` (-1: none)."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def pruned(self, depth: int) -> TokenTree:
        """The nodes at most ``depth`` deep."""
        if max(self.depths, default=0) <= depth:
            return self
        index: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for i, (t, p) in enumerate(zip(self, self.parents, strict=True)):
            if self.depths[i] <= depth:
                index[i] = len(tokens)
                tokens.append(t)
                parents.append(index[p])
        return TokenTree(tokens, parents)

    def first_path(self) -> list[int]:
        """The tokens of the chain of first children (a constrained request's draft)."""
        out, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                out.append(self[i])
                node = i
        return out

    def mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: row j (0: the root, j: node j - 1) sees column m iff m is j
        or one of its ancestors."""
        n = len(self)
        m = torch.zeros((n + 1, n + 1), dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m


def from_continuations(conts: list[list[int]]) -> list[int]:
    """The trie of ``conts`` (the preferred first) as a draft: a ``TokenTree``, or a plain
    list where they form one chain ([] where there are none)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in conts:
        node = -1
        for t in cont:
            nxt = children.get((node, t))
            if nxt is None:
                nxt = children[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = nxt
    return as_draft(TokenTree(tokens, parents))


def as_draft(tree: TokenTree) -> list[int]:
    """``tree`` as the speculator verifies it: a plain list where it is a chain."""
    if all(p == i - 1 for i, p in enumerate(tree.parents)):
        return list(tree)
    return tree


def walk(tree: TokenTree, picks: list[int]) -> tuple[list[int], int]:
    """The accepted nodes of ``tree`` given each row's pick (``picks[0]``: the root's), and
    how many of them are not their parent's first child."""
    first: dict[int, int] = {}  # parent -> its first child
    children: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tree, tree.parents, strict=True)):
        first.setdefault(p, i)
        children.setdefault((p, t), i)
    path: list[int] = []
    branches = 0
    node = -1
    while (nxt := children.get((node, picks[node + 1]))) is not None:
        path.append(nxt)
        branches += first[node] != nxt
        node = nxt
    return path, branches


def depth_and_path(d: list[int], j: int) -> tuple[int, list[int]]:
    """Row ``j`` of the verify entry of draft ``d`` (0: the root): its token index past the
    request's output (its depth) and the drafted tokens before its pick."""
    if not j:
        return 0, []
    if isinstance(d, TokenTree):
        return d.depths[j - 1], [d[i] for i in d.path(j - 1)]
    return j, d[:j]
