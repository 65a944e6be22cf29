"""One replica's speculation: which decoding requests draft, how many tokens, and what a
verify step's picks leave behind.

Contract
--------
* Owned by the replica's scheduler and called from it on the event-loop thread: ``draft``
  while a step is planned, ``accept`` first thing when the step's picks are processed.
* A verify entry of a step is a request running ``1 + k`` tokens (its last token and its k
  drafts, ``ScheduledStep.drafts``) as ``1 + k`` decode rows in a row, whose KV slots stay
  private to it as decodes' do, with ``k + 1`` placeholders and ``k + 1`` rows in
  ``step.sampled``. ``accept`` cuts each entry at its first rejected draft
  (picks, placeholders and the rejected positions' KV, freed at once through the KV manager)
  so that the scheduler's usual loop sees only picks that count, in order.
* A draft that is a ``TokenTree`` (its n nodes, pruned to the request's draft length k) is
  such an entry of 1 + n rows, laid out by ``verify_rows`` (table positions in node order,
  RoPE positions by depth, the tree's mask in ``ForwardBatch.trees``); ``accept`` keeps the
  picks of the root and of the accepted path (``tree.walk``), as the next token indices in
  order, and moves the path's KV into place (``KVManager.keep_path``) before freeing the
  rest. A constrained request, or one whose tree would pass the context, verifies the
  tree's chain of first children instead.
* A step that drafts is built with no step in flight: ``draft`` answers ``NEED_SYNC`` when
  a request would draft while one is (its tokens must be on the host, its grammar masks
  made now), and the scheduler answers ``NEED_SYNC`` while the launched step verifies (the
  next step's positions depend on what it accepts). Speculation therefore runs without
  overlap scheduling in the steps where it drafts.
* A constrained request drafts when its matcher ``Forks``: its drafts are walked on a fork,
  cut at the first the grammar refuses, and each verified position gets the fork's mask
  there (``constrain``, once the step's sampling rows exist); the matcher itself is fed only
  the accepted tokens, by the scheduler's loop.
* Penalties and ``min_new_tokens`` apply per verified position: each row's penalties count
  the drafts before it, its bans its token index (``BatchBuilder.sampling_batch``).
* A request the drafter had no guess for decodes plainly for ``PAUSE_STEPS`` steps (with
  overlap scheduling) before it is asked again. Requests whose matcher does not fork decode
  plainly, never refused. With more than
  ``speculative_max_batch`` requests decoding the step is compute-bound and nothing drafts.
* A drafter that reads the target's hidden states (``drafter.ReadsTarget``) gets them after
  each step through ``features`` (called by the scheduler once the step's picks are in
  place): every token of a prefill chunk or plain decode, a verify entry's root and accepted
  rows, each at the position it now holds; and ``release`` for requests that leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from radixd.core.config import EngineConfig
from radixd.core.constraints import Constraints, Forks
from radixd.core.forward_batch import StepOutput, TokenTrees
from radixd.core.kv_manager import KVManager
from radixd.core.request import Request
from radixd.core.scheduler_interface import NEED_SYNC, ScheduledStep
from radixd.core.speculative.drafter import Drafter, ReadsTarget, Span, to_device
from radixd.core.speculative.tree import TokenTree, as_draft, depth_and_path, walk


@dataclass
class SpecStats:
    verifies: int = 0         # verify entries run (a request verifying its drafts in a step)
    draft_tokens: int = 0     # tokens drafted and verified
    accepted_tokens: int = 0  # of those, accepted
    # token trees (speculative_eagle_topk > 1): verify entries that branched, and accepted
    # nodes that were not their parent's first child (a chain would have missed them)
    trees: bool = False
    tree_verifies: int = 0
    branch_accepted_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as the replica's stats report them (summed over replicas)."""
        out = {"spec_verifies": self.verifies, "spec_draft_tokens": self.draft_tokens,
               "spec_accepted_tokens": self.accepted_tokens}
        if self.trees:
            out |= {"spec_tree_verifies": self.tree_verifies,
                    "spec_branch_accepted_tokens": self.branch_accepted_tokens}
        return out


# Steps a request decodes plainly after its drafter had no guess for it: a step that drafts
# is scheduled without overlap, and asking every step would cost that on every step of a
# request the drafter cannot help (chat for n-gram lookup).
PAUSE_STEPS = 4


class Speculator:
    def __init__(self, config: EngineConfig, drafter: Drafter, kv_manager: KVManager, constraints: Constraints, *,
                 context_len: int):
        self.drafter = drafter
        self.kv = kv_manager
        self.constraints = constraints
        self._masks: dict[Request, np.ndarray] = {}  # constrained drafts' masks, for ``constrain``
        self.max_k = config.speculative_num_draft_tokens
        self.adaptive = config.speculative_adaptive
        self.max_batch = config.speculative_max_batch
        self.context_len = context_len
        self.stats = SpecStats(trees=config.speculative_eagle_topk > 1)
        self.reads = isinstance(drafter, ReadsTarget)
        # verify entries' kept rows (0: the root, j: its j-th row), by ``accept`` for ``features``
        self._kept: dict[Request, list[int]] = {}

    def draft(self, decoding: list[Request], inflight: bool) -> dict[Request, list[int]] | object:
        """The drafts of this step's decoding requests (those without one decode plainly),
        or ``NEED_SYNC`` (``inflight``: a step is launched and not processed; see the contract)."""
        self._masks.clear()
        if not decoding or (self.max_batch and len(decoding) > self.max_batch):
            return {}
        want, ks = [], []
        for r in decoding:
            k = self._length(r)
            if k:
                if inflight:
                    return NEED_SYNC
                want.append(r)
                ks.append(k)
        if not want:
            return {}
        drafts = {}
        for r, k, d in zip(want, ks, self.drafter.propose(want, ks), strict=True):
            if isinstance(d, TokenTree):
                d = d.pruned(k)
                # (a constrained request's drafts are walked on one fork: its preferred chain;
                # and a tree's rows must fit the table row, whose columns are the context's)
                d = d.first_path() if r.matcher is not None or len(d) > self.context_len - r.seq_len else as_draft(d)
            else:
                d = list(d[:k])
            if d and r.matcher is not None:
                d = self._fit_grammar(r, d)
            if d:
                drafts[r] = d
            else:  # no guess: decode plainly (and overlapped) for a while before asking again
                r.draft_len = -PAUSE_STEPS
        return drafts

    def _fit_grammar(self, r: Request, d: list[int]) -> list[int]:
        """``d`` up to its first token ``r``'s grammar refuses, walked on a fork of its matcher;
        the masks of the positions after the kept drafts go to ``constrain``."""
        m = r.matcher.fork()
        if m is None:
            return []
        left = self.constraints.tokens_left(r)
        rows = np.empty((len(d) + 1, self.constraints.vocab_size), dtype=bool)  # [i]: after d[:i]
        kept = len(d)
        for i, t in enumerate(d):
            self.constraints.fill_row(m, rows[i], left - i)
            if not rows[i, t] or not m.accept_token(t):
                kept = i
                break
        else:
            self.constraints.fill_row(m, rows[kept], left - kept)
        if kept:
            self._masks[r] = rows[1 : kept + 1]
        return d[:kept]

    def constrain(self, step: ScheduledStep) -> None:
        """Give the built step's rows after each constrained verify entry's first the masks of
        its drafts' positions (the first row has the matcher's own, as every constrained row)."""
        if not self._masks:
            return
        allowed = step.batch.sampling.allowed
        seen: set[Request] = set()
        for j, r in enumerate(step.sampled):
            if r in self._masks and r not in seen:
                seen.add(r)
                rows = self._masks[r]
                allowed[j + 1 : j + 1 + len(rows)] = torch.from_numpy(rows)
        self._masks.clear()

    def _length(self, r: Request) -> int:
        """How many tokens ``r`` drafts now (0: it decodes plainly)."""
        p = r.params
        out = len(r.output_ids)
        if r.draft_len < 0:  # pausing after a step without a guess
            r.draft_len += 1
            return 0
        if r.matcher is not None and not self.constraints.has(r.matcher, Forks):
            return 0
        # (a verify yields up to k + 1 tokens, and its last position must fit the context)
        return max(0, min(r.draft_len or self.max_k, p.max_new_tokens - out - 1, self.context_len - r.seq_len))

    def accept(self, step: ScheduledStep, out: StepOutput) -> None:
        """Cut each verify entry of ``step`` at its first rejected draft (see the contract):
        ``step.sampled``, ``step.pick_index`` and ``out``'s per-pick lists keep the picks
        that count."""
        drafts = step.drafts
        sampled, toks = step.sampled, out.next_tokens
        keep: list[int] = []
        picks: list[int] = []  # the kept rows' token indices (a tree's accepted rows: the next ones)
        i = 0
        while i < len(sampled):
            r = sampled[i]
            d = drafts.get(r)
            if d is None:
                keep.append(i)
                picks.append(step.pick_index[i])
                i += 1
                continue
            k = len(d)
            if isinstance(d, TokenTree):
                path, branches = walk(d, toks[i : i + k + 1])
                a = len(path)
                keep.extend([i] + [i + 1 + n for n in path])
                if self.reads:
                    self._kept[r] = [0] + [1 + n for n in path]
                self.kv.keep_path(r, r.kv.length - k, path)
                self.stats.tree_verifies += 1
                self.stats.branch_accepted_tokens += branches
                depth = max(d.depths)
            else:
                a = 0
                while a < k and toks[i + a] == d[a]:
                    a += 1
                keep.extend(range(i, i + a + 1))
                if self.reads:
                    self._kept[r] = list(range(a + 1))
                depth = k
            picks.extend(range(step.pick_index[i], step.pick_index[i] + a + 1))
            rejected = k - a
            if rejected:  # the last placeholders are the rejected picks' (the step was synchronous)
                del r.output_ids[len(r.output_ids) - rejected :]
                r.unresolved -= rejected
                self.kv.truncate(r, r.kv.length - rejected)
            self._learn(r, depth, a, k)
            i += k + 1
        if len(keep) == len(sampled):
            return
        step.sampled = [sampled[j] for j in keep]
        step.pick_index = picks
        out.next_tokens = [toks[j] for j in keep]
        if out.logprobs is not None:
            out.logprobs = [out.logprobs[j] for j in keep]
        if out.top_logprobs is not None:
            out.top_logprobs = [out.top_logprobs[j] for j in keep]

    def features(self, step: ScheduledStep, aux: torch.Tensor) -> None:
        """Hand a ``ReadsTarget`` drafter the streams of ``step``'s positions that count (see
        the contract): ``aux`` holds every token's, in the batch's flat order."""
        b = step.batch
        reqs, drafts, kept = step.reqs, step.drafts, self._kept
        aside: set[Request] = set()
        if not drafts and self.max_batch and sum(n == 1 for n in b.extend_lens) > self.max_batch:
            # speculation stepped aside (a compute-bound batch): the drafter does not follow
            # decode rows; their states go, and a later step that drafts starts them over
            aside = {r for r, n in zip(reqs, b.extend_lens, strict=True) if n == 1}
            self.drafter.release(list(aside))
        spans: list[Span] = []
        rows: list[int] = []
        off = i = 0
        while i < len(reqs):
            r = reqs[i]
            d = drafts.get(r)
            if d is None:
                n = b.extend_lens[i]
                if r not in aside:
                    spans.append(Span(r, b.prefix_lens[i], n))
                    rows.extend(range(off, off + n))
                i += 1
            else:  # (one row per position: the rows' flat index is their entry's)
                path = kept.pop(r, [0])
                spans.append(Span(r, b.prefix_lens[i], len(path)))
                rows.extend(off + j for j in path)
                n = len(d) + 1
                i += n
            off += n
        if not spans:
            return
        if len(rows) != aux.shape[0]:
            aux = aux.index_select(0, to_device(rows, aux.device))
        self.drafter.features(spans, aux)

    def release(self, reqs: list[Request]) -> None:
        """``reqs`` left the running set (a ``ReadsTarget`` drafter drops their state)."""
        if self.reads and reqs:
            self.drafter.release(reqs)

    def _learn(self, r: Request, k: int, accepted: int, drafted: int | None = None) -> None:
        """Count a verify entry (``drafted`` tokens, default ``k``, of a draft ``k`` deep);
        adapt ``r``'s draft length: two more after a fully accepted draft, one less after a
        rejection (at least one)."""
        st = self.stats
        st.verifies += 1
        st.draft_tokens += k if drafted is None else drafted
        st.accepted_tokens += accepted
        if self.adaptive:
            r.draft_len = min(self.max_k, k + 2) if accepted == k else max(1, k - 1)


class VerifyLayout(NamedTuple):
    offsets: list[int]            # each row's token index past len(output_ids) (its depth)
    paths: list[list[int]]        # the drafted tokens before each row's pick (penalties)
    prefix_lens: list[int]        # each row's table position
    trees: TokenTrees | None      # the tree entries' rows and masks


def verify_rows(dec: list[Request], drafts: dict[Request, list[int]], ids: list[int], pos: list[int]) -> VerifyLayout:
    """Lay out a decode batch's verify entries in place: the j-th row of a verifying request
    (its rows follow one another) runs ``drafts[r][j - 1]`` (row 0: its last token) at table
    position ``pos + j``, and at RoPE position ``pos + depth`` (a chain's: j; ``ids`` and
    ``pos`` are rewritten to those)."""
    offsets = [0] * len(dec)
    paths: list[list[int]] = [[]] * len(dec)
    table = pos.copy()
    first, sizes, masks = [], [], []
    j = 0
    for i, r in enumerate(dec):
        d = drafts.get(r)
        if d is None:
            continue
        j = j + 1 if i and dec[i - 1] is r else 0
        if not j:
            root = pos[i]
            if isinstance(d, TokenTree):
                first.append(i)
                sizes.append(len(d) + 1)
                masks.append(d.mask())
            continue
        ids[i] = d[j - 1]
        offsets[i], paths[i] = depth_and_path(d, j)
        pos[i] = root + offsets[i]
        table[i] = root + j
    return VerifyLayout(offsets, paths, table, TokenTrees(first, sizes, masks) if first else None)
