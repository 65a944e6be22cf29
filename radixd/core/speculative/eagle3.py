"""The ``eagle3`` drafter: an EAGLE-3 draft head (SGLang's checkpoint layout, ``eagle3_head``)
drafting from the model's own hidden states.

Contract
--------
* One per replica, from ``speculative_draft_model_path``: the head is read and checked
  against the model before any weights load (``target_layers``, the ``ReadsTarget``
  capability: the replica's worker then hands back the residual stream after three of the
  model's layers at every token it computes). ``attach`` puts the head on the worker's device
  in the engine's dtype, sharing the model's embedding (and LM head where the head has none),
  with a one-layer KV region of ``speculative_draft_kv_tokens`` slots, table rows of its own
  and the engine's attention backend. Everything runs on the event loop's thread.
* Per request a ``_State``: a table row, and the KV slots of positions ``base .. end - 1``,
  whose pairs (token t + 1, the model's stream at t) the head has run, kept in the row at
  positions from 0 (``base``: the first position the model computed since the request's
  admission; a prefix served from the radix cache is not seen by the head); the head's
  output stream and likeliest next tokens (with their log-probabilities) at position ``end - 1``.
* ``features``, after every step: the head runs the new pairs of all requests in one extend
  (their tokens are known by then), so it follows each sequence as the model computes it,
  drafting or not. A request's positions starting past ``end`` (a gap) or before it (computed
  again) start its state over from there.
* ``propose``: greedy chains, all requests together: the first draft is the likeliest token
  at ``end - 1``, each next one a decode step of the head on the draft before it and its own
  output stream (in slots given back at the end of the call); the drafts are read from the
  device once. A request whose state does not end at its last token has no guess.
* With ``speculative_eagle_topk`` = w > 1 a draft of depth k is a token tree, grown as EAGLE
  grows it: w beams, the w likeliest first tokens; at each further depth every beam's w
  likeliest next tokens are candidates, scored by the sum of log-probabilities along their
  path, and the w best become the beams (each on a table row of its own holding the
  request's pairs and its path; a beam that two candidates follow is copied). The tree is the
  w * k candidates of all depths with the best scores (a candidate's parent scores at least
  as well), each node's children best first. At most ``speculative_max_batch`` (else
  ``max_running_requests``) requests grow trees in a call; the rest draft chains.
* Drafts are point proposals (greedy), so verification keeps the output exact.
* ``release`` gives a request's row and slots back (finished, aborted, preempted; a request
  found outside the running set at a ``propose`` too). With the region or the rows full a
  request has no state, and drafts nothing, until a later step's positions start one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from radixd.core.assembly import pick_dtype
from radixd.core.attention import make_backend
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import KVPool, RowAllocator, SlotAllocator
from radixd.core.models.config import ModelConfig
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request, State
from radixd.core.scheduler_interface import PLACEHOLDER
from radixd.core.speculative.drafter import Span, to_device
from radixd.core.speculative.eagle3_head import KEY, Eagle3Head, load_head, read_head
from radixd.core.speculative.tree import TokenTree, as_draft
from radixd.core.triton_ops import linear
from radixd.core.worker import ModelWorker, on_device


class _State:
    __slots__ = ("row", "base", "end", "slots", "g", "top", "topv")

    def __init__(self, row: int, base: int):
        self.row = row
        self.base = base  # the first position the head has (the row's position 0)
        self.end = base   # past the last position the head ran
        self.slots = torch.empty(0, dtype=torch.int64)
        self.g: torch.Tensor | None = None    # [H] the head's output stream at end - 1
        self.top: torch.Tensor | None = None  # [w] the likeliest tokens after it (the model's ids)
        self.topv: torch.Tensor | None = None  # [w] their log-probabilities


def head_path(config: EngineConfig) -> Path:
    if not config.speculative_draft_model_path:
        raise ConfigError(KEY, "", 'an EAGLE-3 head checkpoint (speculative_algorithm is "eagle3")')
    return Path(config.speculative_draft_model_path).expanduser()


class Eagle3Drafter:
    name = "eagle3"

    @classmethod
    def target_layers(cls, config: EngineConfig, target: ModelConfig) -> tuple[int, ...]:
        return read_head(head_path(config), target).layers

    def __init__(self, config: EngineConfig, cache: RadixCache):
        self.config = config
        self.path = head_path(config)
        self.width = config.speculative_eagle_topk
        self.states: dict[Request, _State] = {}
        self.head: Eagle3Head | None = None  # (``attach``)

    def attach(self, target: ModelWorker) -> None:
        c = self.config
        spec = read_head(self.path, target.model_cfg)
        dev = target.device
        dtype = pick_dtype(c.dtype, dev)
        context = target.pool.req_to_token.shape[1]
        slots = c.speculative_draft_kv_tokens + 1
        # rows past the requests' own: the beams of the requests growing trees in a call
        self.trees = min(c.speculative_max_batch or c.max_running_requests, c.max_running_requests)
        self.beams = c.max_running_requests
        rows = c.max_running_requests + (self.trees * self.width if self.width > 1 else 0)
        backend = c.attention_backend
        if backend == "auto":
            backend = "triton" if dev.type == "cuda" else "torch"
        with on_device(dev):
            self.head = load_head(spec, target.model, dtype, dev, context)
            self.pool = KVPool(num_layers=1, num_slots=slots, num_kv_heads=spec.cfg.num_kv_heads,
                               head_dim=spec.cfg.head_dim, max_rows=rows,
                               max_context_len=context, dtype=dtype, device=dev)
            self.attn = make_backend(backend, self.pool, num_heads=spec.cfg.num_heads, head_dim=spec.cfg.head_dim,
                                     scale=spec.cfg.attention_scale, fuse_one_row=c.fuse_one_row)
        self.device = dev
        self.allocator = SlotAllocator(slots)
        self.rows = RowAllocator(c.max_running_requests)

    # ------------------------------------------------------------------ following the model

    def features(self, spans: list[Span], aux: torch.Tensor) -> None:
        runs: list[tuple[_State, torch.Tensor, int]] = []  # (state, new slots, pairs)
        ids: list[int] = []
        rows: list[int] = []  # aux rows the pairs take
        off = 0
        for r, start, n in spans:
            lo, off = off, off + n
            if r.finish_reason is not None or r.aborted:
                continue
            toks = r.tokens(start + 1, start + n + 1)  # each position's next token
            if PLACEHOLDER in toks:
                toks = toks[: toks.index(PLACEHOLDER)]
            m = min(len(toks), self.head.positions - start)
            st = self._state(r, start) if m > 0 else None
            if st is None:
                continue
            new = self.allocator.alloc(m)
            if new is None:  # the region is full: no state (a later step's positions start one)
                self._drop(r)
                continue
            runs.append((st, new, m))
            ids += toks[:m]
            rows.extend(range(lo, lo + m))
        if not runs:
            return
        with torch.inference_mode():
            if len(rows) != aux.shape[0]:
                aux = aux.index_select(0, to_device(rows, aux.device))
            g = linear(aux, self.head.fc)
            stream, normed = self._run(torch.tensor(ids, dtype=torch.int64), g,
                                       [(st.row, st.base, st.end, m) for st, _, m in runs], [s for _, s, _ in runs],
                                       last=True)
            top = self.head.logits(normed).log_softmax(dim=-1).topk(self.width, dim=-1)
            ids_out = self.head.to_target(top.indices)
        for i, (st, new, m) in enumerate(runs):
            st.slots = torch.cat((st.slots, new))
            st.end += m
            st.g, st.top, st.topv = stream[i], ids_out[i], top.values[i]

    def _state(self, r: Request, start: int) -> _State | None:
        """``r``'s state, ending at ``start`` (made, started over or cut back to it); None
        without a free row."""
        st = self.states.get(r)
        if st is not None and not st.base <= start <= st.end:
            self._drop(r)  # a gap: start over from here
            st = None
        if st is None:
            row = self.rows.alloc()
            if row is None:
                return None
            st = self.states[r] = _State(row, start)
        elif start < st.end:  # computed again: the head's pairs from there are stale
            self.allocator.free(st.slots[start - st.base :])
            st.slots = st.slots[: start - st.base]
            st.end = start
            st.g = st.top = st.topv = None
        return st

    def _run(self, ids: torch.Tensor, g: torch.Tensor, runs: list[tuple[int, int, int, int]],
             slots: list[torch.Tensor], last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the head: each ``(table row, base, first position, count)`` runs that
        many positions (the row holds position p at p - base). Returns the output streams and
        their normed values: each run's last row (``last``), else all."""
        pos: list[int] = []
        cols: list[int] = []
        rows, prefix, extend = [], [], []
        for row, base, first, n in runs:
            pos.extend(range(first, first + n))
            cols.extend(range(first - base, first - base + n))
            rows.append(row)
            prefix.append(first - base)
            extend.append(n)
        loc = torch.cat(slots) if len(slots) > 1 else slots[0]
        batch = ForwardBatch(input_ids=ids, positions=torch.tensor(pos, dtype=torch.int64), out_cache_loc=loc,
                             rows=rows, prefix_lens=prefix, extend_lens=extend)
        dev = self.device
        row_of = torch.tensor(rows, dtype=torch.int64).repeat_interleave(torch.tensor(extend, dtype=torch.int64))
        self.pool.req_to_token[to_device(row_of, dev), to_device(cols, dev)] = to_device(loc, dev)
        self.attn.begin(batch, lambda t: to_device(torch.as_tensor(t, dtype=torch.int64), dev))
        at = None
        if last and len(pos) != len(runs):
            at = to_device(torch.tensor(extend, dtype=torch.int64).cumsum(0) - 1, dev)
        return self.head(to_device(ids, dev), g, to_device(batch.positions, dev), self.attn, at)

    # ------------------------------------------------------------------ drafting

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        self._collect()
        ready: list[tuple[int, _State, int]] = []  # (index in reqs, state, draft length)
        for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            st = self.states.get(r)
            if st is None or st.top is None or st.end != r.seq_len - 1:
                continue
            k = min(k, self.head.positions - st.end + 1)  # (the chain's positions: end .. end + k - 2)
            if k >= 1:
                ready.append((i, st, k))
        out: list[list[int]] = [[] for _ in reqs]
        if not ready:
            return out
        ready.sort(key=lambda x: -x[2])  # (the requests still drafting at each step: a prefix)
        grow = ready[: self.trees] if self.width > 1 else []
        chained = ready[len(grow) :]
        for (i, _, _), d in zip(grow, self._trees([st for _, st, _ in grow], [k for _, _, k in grow]), strict=True):
            out[i] = d
        for (i, _, _), d in zip(chained, self._chains([st for _, st, _ in chained], [k for _, _, k in chained]),
                                strict=True):
            out[i] = d
        return out

    def _chains(self, states: list[_State], ks: list[int]) -> list[list[int]]:
        """Greedy chains of ``ks`` tokens (descending) after each state (see the contract)."""
        if not states:
            return []
        first = torch.stack([st.top[0] for st in states])
        steps = [first]
        temp: list[torch.Tensor] = []
        with torch.inference_mode():
            tok, g = first, torch.stack([st.g for st in states])
            for j in range(1, ks[0]):
                live = sum(1 for k in ks if k > j)
                new = self.allocator.alloc(live)
                if new is None:
                    break
                temp.append(new)
                g, normed = self._run(tok[:live], g[:live], [(st.row, st.base, st.end + j - 1, 1)
                                                             for st in states[:live]], [new], last=False)
                tok = self.head.to_target(self.head.logits(normed).argmax(dim=-1))
                steps.append(tok)
            flat = torch.cat(steps).tolist()
        for slots in temp:
            self.allocator.free(slots)
        chains: list[list[int]] = [[] for _ in states]
        at = 0
        for step in steps:  # (each step's requests: the first n)
            n = step.numel()
            for c, t in zip(chains[:n], flat[at : at + n], strict=True):
                c.append(t)
            at += n
        return chains

    def _trees(self, states: list[_State], ks: list[int]) -> list[list[int]]:
        """Token trees of ``ks`` depths (descending) after each state, grown by beams (see the
        contract); each a ``TokenTree`` (a list where it is a chain)."""
        if not states:
            return []
        w, b, dev = self.width, len(states), self.device
        table = self.pool.req_to_token
        beam_rows = torch.arange(self.beams, self.beams + b * w, device=dev).view(b, w)
        for i, st in enumerate(states):  # each beam's row starts with the request's pairs
            n = st.end - st.base
            table[beam_rows[i], :n] = table[st.row, :n]
        tok = torch.stack([st.top for st in states])      # [b, w] the beams' last tokens
        score = torch.stack([st.topv for st in states])   # [b, w] their paths' log-probabilities
        node = torch.arange(w, device=dev).expand(b, w)   # [b, w] the beams' candidates
        cands = [(tok, score, torch.full((b, w), -1, device=dev))]  # per depth: token, score, parent
        temp: list[torch.Tensor] = []
        with torch.inference_mode():
            g = torch.stack([st.g for st in states])[:, None].expand(b, w, -1)
            made = w
            for j in range(1, ks[0]):
                live = sum(1 for k in ks if k > j)
                new = self.allocator.alloc(live * w)
                if new is None:
                    break
                temp.append(new)
                runs = [(self.beams + i * w + m, st.base, st.end + j - 1, 1)
                        for i, st in enumerate(states[:live]) for m in range(w)]
                stream, normed = self._run(tok[:live].reshape(-1), g[:live].reshape(live * w, -1), runs, [new],
                                           last=False)
                top = self.head.logits(normed).log_softmax(dim=-1).topk(w, dim=-1)
                ids = self.head.to_target(top.indices).view(live, w * w)
                cum = (score[:live, :, None] + top.values.view(live, w, w)).view(live, w * w)
                cands.append((ids, cum, node[:live, :, None].expand(live, w, w).reshape(live, w * w)))
                best = cum.topk(w, dim=-1).indices              # the next beams
                parent = best // w
                tok, score, node = ids.gather(1, best), cum.gather(1, best), made + best
                made += w * w
                g = stream.view(live, w, -1).gather(1, parent[..., None].expand(live, w, stream.shape[-1]))
                if j + 1 < ks[0]:  # each new beam's row takes its parent's path so far
                    ends = to_device([st.end - st.base for st in states[:live]], dev)
                    cols = (ends[:, None] + torch.arange(j, device=dev))[:, None, :]
                    src = beam_rows[:live].gather(1, parent)
                    table[beam_rows[:live, :, None], cols] = table[src[..., None], cols]
            flat = torch.cat([torch.cat([t.flatten(), s.flatten().float(), p.flatten().float()])
                              for t, s, p in cands]).tolist()
        for slots in temp:
            self.allocator.free(slots)
        return _select(flat, [c[0].shape for c in cands], ks, w)

    # ------------------------------------------------------------------ leaving

    def release(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._drop(r)

    def _drop(self, r: Request) -> None:
        st = self.states.pop(r, None)
        if st is not None:
            self.allocator.free(st.slots)
            self.rows.free(st.row)

    def _collect(self) -> None:
        """Drop the states of requests no longer running (``release`` missed none so far;
        this keeps it so)."""
        for r in [r for r in self.states if r.state is not State.RUNNING]:
            self._drop(r)


def _select(flat: list, shapes: list[torch.Size], ks: list[int], w: int) -> list[list[int]]:
    """Per request, the tree of its ``w * k`` best-scored candidates, read from ``flat`` (per
    depth: tokens, scores, parents of ``shapes[d]`` = [requests, candidates])."""
    nodes: list[list[tuple[float, int, int, int, int]]] = [[] for _ in ks]  # (-score, depth, id, parent, token)
    at, made = 0, 0
    for depth, (n, m) in enumerate(shapes):
        size = n * m
        toks, scores, parents = flat[at : at + size], flat[at + size : at + 2 * size], flat[at + 2 * size : at + 3 * size]
        at += 3 * size
        for i in range(n):
            for c in range(m):
                x = i * m + c
                nodes[i].append((-scores[x], depth, made + c, int(parents[x]), int(toks[x])))
        made += m
    out = []
    for k, cand in zip(ks, nodes, strict=True):
        kept: dict[int, tuple] = {}
        for nd in sorted(cand):  # (best first; a parent before its children on a tie)
            if nd[3] < 0 or nd[3] in kept:
                kept[nd[2]] = nd
                if len(kept) == w * k:
                    break
        order = sorted(kept.values(), key=lambda nd: (nd[1], nd[0]))  # by depth, each node's children best first
        index = {nd[2]: j for j, nd in enumerate(order)}
        tree = TokenTree([nd[4] for nd in order], [index.get(nd[3], -1) for nd in order])
        out.append(as_draft(tree))
    return out
