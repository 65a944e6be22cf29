"""The ``standalone`` drafter: a smaller checkpoint sharing the target's tokenizer drafts by
greedy decoding, on a KV region of its own.

Contract
--------
* One per replica, made from ``speculative_draft_model_path`` (the engine's device kind and
  dtype; the first device with dp_size > 1): its own ``ModelWorker`` (weights, KV pool of
  ``speculative_draft_kv_tokens`` slots, table rows, attention backend, and, where the
  engine's ``cuda_graphs`` is on, decode graphs that its one-token steps replay). Called on
  the event loop like any drafter; its forwards run there too (steps that draft are
  synchronous, so the target's worker is idle meanwhile).
* Per drafting request a ``_State``: a table row and the slots of the tokens whose draft KV is
  computed. A call keeps the longest prefix of those tokens that the request's sequence still
  starts with (the drafts the target accepted), frees the rest at once, computes the missing
  tokens of the sequence in one extend for all requests (its last logits give each first
  draft), then decodes the other drafts a step at a time for all requests together.
* A request's row and slots go back at the first call after it left the running set (its
  state WAITING or FINISHED). With the draft pool or its rows full a request drafts nothing.
* Drafts are greedy: point proposals, so the target's verification keeps its output exact.
  With ``speculative_eagle_topk`` = w > 1 a draft is a token tree: the greedy chain and the
  first step's w - 1 next likeliest tokens beside its first (their logits are computed
  anyway: no more draft forwards).
"""

from __future__ import annotations

import torch

from radixd.core.assembly import pick_device, pick_dtype
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.forward_batch import ForwardBatch
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.model_loader import read_config, resolve_model
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request, State
from radixd.core.speculative.tree import from_continuations
from radixd.core.worker import ModelWorker, on_device


class _State:
    __slots__ = ("row", "slots", "tokens")

    def __init__(self, row: int):
        self.row = row
        self.slots = torch.empty(0, dtype=torch.int64)
        self.tokens: list[int] = []  # whose draft KV is in ``slots``


class DraftModel:
    name = "standalone"

    def __init__(self, config: EngineConfig, cache: RadixCache):
        if not config.speculative_draft_model_path:
            raise ConfigError("speculative_draft_model_path", "", 'a checkpoint (speculative_algorithm is "standalone")')
        path = resolve_model(config.speculative_draft_model_path, config.cache_dir)
        cfg = read_config(path)
        target = read_config(resolve_model(config.model, config.cache_dir))
        if cfg.vocab_size > target.vocab_size:
            raise ConfigError("speculative_draft_model_path", str(path), f"a model of the target's tokenizer (its "
                              f"vocabulary has {cfg.vocab_size} ids, the target's {target.vocab_size})")
        device = pick_device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        slots = config.speculative_draft_kv_tokens + 1
        with on_device(device):
            self.worker = ModelWorker(model_path=path, model_cfg=cfg, device=device,
                                      dtype=pick_dtype(config.dtype, device),
                                      attention_backend="triton" if device.type == "cuda" else "torch",
                                      load_format=config.load_format, kv_slots=lambda free: slots,
                                      max_rows=config.max_running_requests, cuda_graphs=config.cuda_graphs,
                                      max_context_len=min(cfg.context_len, target.context_len))
        self.allocator = SlotAllocator(slots)
        self.rows = RowAllocator(config.max_running_requests)
        self.states: dict[Request, _State] = {}
        self.width = config.speculative_eagle_topk

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        self._collect()
        runs: list[tuple[Request, _State, list[int], int]] = []  # (request, state, tokens to run, start)
        for r in reqs:
            st = self.states.get(r)
            if st is None:
                row = self.rows.alloc()
                if row is None:
                    continue
                st = self.states[r] = _State(row)
            seq = r.seq
            keep = 0
            limit = min(len(st.tokens), len(seq) - 1)  # (at least the last token runs: its logits)
            while keep < limit and st.tokens[keep] == seq[keep]:
                keep += 1
            self._truncate(st, keep)
            runs.append((r, st, seq[keep:], keep))
        drafts = {r: [] for r in reqs}
        others: dict[Request, list[int]] = {}  # the first step's next likeliest tokens
        first = self._step([(st, toks, start) for _, st, toks, start in runs], self.width)
        live = []
        for (r, st, _, _), top in zip(runs, first, strict=True):
            if top is not None:
                st.tokens = r.seq
                drafts[r].append(top[0])
                others[r] = top[1:]
                live.append((r, st))
        want = dict(zip(reqs, ks, strict=True))
        for _ in range(max(ks, default=0) - 1):
            live = [(r, st) for r, st in live if len(drafts[r]) < want[r]]
            if not live:
                break
            nxt = self._step([(st, [drafts[r][-1]], len(st.tokens)) for r, st in live])
            for (r, st), top in zip(live, nxt, strict=True):
                if top is not None:
                    st.tokens.append(drafts[r][-1])
                    drafts[r].append(top[0])
            live = [(r, st) for (r, st), top in zip(live, nxt, strict=True) if top is not None]
        if self.width > 1:
            return [from_continuations([drafts[r]] + [[t] for t in others.get(r, ())]) for r in reqs]
        return [drafts[r] for r in reqs]

    def _step(self, runs: list[tuple[_State, list[int], int]], top: int = 1) -> list[list[int] | None]:
        """One forward: each state runs its tokens from position ``start``; the ``top``
        likeliest next tokens of each, the greedy one first (None where the pool had no
        slots for it: it ran nothing)."""
        got: list[list[int] | None] = [None] * len(runs)
        ids, pos, rows, prefix, extend, slots, which = [], [], [], [], [], [], []
        for i, (st, toks, start) in enumerate(runs):
            new = self.allocator.alloc(len(toks))
            if new is None:
                continue
            st.slots = torch.cat((st.slots, new))
            ids += toks
            pos += range(start, start + len(toks))
            rows.append(st.row)
            prefix.append(start)
            extend.append(len(toks))
            slots.append(new)
            which.append(i)
        if not which:
            return got
        batch = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.int64),
                             positions=torch.tensor(pos, dtype=torch.int64), out_cache_loc=torch.cat(slots),
                             rows=rows, prefix_lens=prefix, extend_lens=extend, write_new_slots=True,
                             sample_indices=list(range(len(which))))
        with on_device(self.worker.device):
            logits = self.worker.forward(batch)
            picks = (logits.argmax(dim=-1)[:, None] if top == 1 else logits.topk(top, dim=-1).indices).tolist()
        for i, tok in zip(which, picks, strict=True):
            got[i] = tok
        return got

    def _truncate(self, st: _State, keep: int) -> None:
        if keep < len(st.tokens):
            self.allocator.free(st.slots[keep:])
            st.slots = st.slots[:keep]
            st.tokens = st.tokens[:keep]

    def _collect(self) -> None:
        """Give back the rows and slots of requests that left the running set."""
        for r in [r for r in self.states if r.state is not State.RUNNING]:
            st = self.states.pop(r)
            self.allocator.free(st.slots)
            self.rows.free(st.row)
