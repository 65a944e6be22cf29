"""Batch building: a step's plan (which requests run how many tokens) as a ``ForwardBatch``.

Contract
--------
* The scheduler hands ``build`` a plan whose KV room it made, with the step's fresh slots;
  ``build`` lays the tokens out flat (input ids, positions, table rows and the table writes
  each request had queued), marks placeholders (tokens still on the device), the positions
  of wanted prompt logprobs and those whose hidden states embedding requests pool, and
  batches the sampling inputs of the requests that pick a token. It appends the step's slots
  to each request's ``KVHandle`` and takes its ``table_writes``; it changes nothing else of a
  request (committing the step is the scheduler's and the KV manager's).
* Reuse across steps: while the same requests decode in the same order, the batched constant
  sampling rows and the cascade plan are kept, not rebuilt (both are compared at C speed).
* The loops here run for every request every step: flat Python lists and one
  ``torch.tensor`` call per field, no tensor work per request.
"""

from __future__ import annotations

import torch

from radixd.core import cascade
from radixd.core.constraints import Constraints
from radixd.core.forward_batch import ForwardBatch, SamplingBatch
from radixd.core.request import Request
from radixd.core.scheduler_interface import PLACEHOLDER, ScheduledStep, SchedulerStats
from radixd.core.speculative.speculator import verify_rows


class BatchBuilder:
    def __init__(self, *, eos_token_ids: tuple[int, ...], max_top_logprobs: int, constraints: Constraints,
                 stats: SchedulerStats):
        self.eos = eos_token_ids
        self.max_top_logprobs = max_top_logprobs
        self.constraints = constraints
        self.stats = stats
        self._last_plan: tuple | None = None  # (requests, chains, rows, plan) of the last decode step
        self._sampling_cache: _SamplingRows | None = None  # the last step's batched sampling rows

    def build(self, plan: list[tuple[Request, int]], decoding: int, new_slots: torch.Tensor,
              cascade_members: int = 0, drafts: dict[Request, list[int]] | None = None) -> ScheduledStep:
        """The step's batch. ``plan[:decoding]`` are decodes: requests whose last token is
        all they run (the common case, built on a shorter path). ``new_slots``: one per token
        of the plan, in order. ``cascade_members``: requests per shared-prefix item of a
        decode batch (0: no cascade plan). ``drafts``: the verify entries' drafts; such a
        request is one decode of the plan per position it verifies, in a row (its last token,
        then each draft, one position further: a decode batch, CUDA graphs and all)."""
        ids: list[int] = []
        pos: list[int] = []
        rows, prefix_lens, extend_lens, writes = [], [], [], []
        sampled_idx: list[int] = []
        flat_slots = new_slots.tolist()
        off = 0
        prefill_tokens = 0
        ph_pos: list[int] = []
        ph_req: list[Request] = []
        lp_pos: list[int] = []
        lp_target: list[int] = []
        lp_reqs: list[tuple[Request, int]] = []
        lp_top = 0
        pool_pos: list[int] = []
        pool_row: list[int] = []
        pool_reqs: list[tuple[Request, int, bool]] = []
        layout = None  # verify entries' rows (speculator.VerifyLayout)
        if decoding:  # the plan starts with them: one token each, the last of their sequence
            dec = [r for r, _ in plan[:decoding]]
            kvs = [r.kv for r in dec]
            ids = [0 if (t := r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]) == PLACEHOLDER else t
                   for r in dec]
            pos = [kv.length for kv in kvs]
            if drafts:
                layout = verify_rows(dec, drafts, ids, pos)
            rows = [kv.row for kv in kvs]
            prefix_lens = layout.prefix_lens if layout is not None else pos.copy()
            extend_lens = [1] * decoding
            sampled_idx = list(range(decoding))
            for i, (r, kv, slot) in enumerate(zip(dec, kvs, flat_slots, strict=False)):  # (then prefills)
                if r.unresolved:
                    ph_pos.append(i)
                    ph_req.append(r)
                if kv.table_writes:
                    for start, slots in kv.table_writes:
                        writes.append((kv.row, start, slots))
                    kv.table_writes.clear()
                kv.append_slot(slot)
            off = decoding
        for i, (r, n) in enumerate(plan[decoding:], start=decoding):
            kv = r.kv
            start = kv.length
            prompt = r.prompt_ids
            plen = len(prompt)
            seq_len = plen + len(r.output_ids)
            end = start + n
            if r.params.prompt_logprobs_from is not None and (missing := r.prompt_lp_missing) is not None:
                # positions q of this chunk whose logits predict prompt[q + 1]
                qs = range(max(start, missing - 1), min(end, plen - 1))
                lp_pos.extend(len(ids) + q - start for q in qs)
                lp_target.extend(prompt[q + 1] for q in qs)
                if qs:
                    lp_reqs.append((r, len(qs)))
                    lp_top = max(lp_top, r.params.prompt_top_logprobs)
            if r.pool is not None:  # an embedding request: its wanted positions' hidden states
                qs = r.pool.wanted(start, end)
                pool_pos.extend(len(ids) + q - start for q in qs)
                pool_row.extend([len(pool_reqs)] * len(qs))
                pool_reqs.append((r, len(qs), end == seq_len))
            if r.unresolved and end == seq_len:  # its last token is a pending pick
                ph_pos.append(len(ids) + n - 1)
                ph_req.append(r)
            if n == 1:
                tok = r.output_ids[start - plen] if start >= plen else prompt[start]
                ids.append(0 if tok == PLACEHOLDER else tok)
                pos.append(start)
            else:
                ids.extend(0 if t == PLACEHOLDER else t for t in r.tokens(start, end))
                pos.extend(range(start, end))
            if kv.table_writes:
                for w_start, slots in kv.table_writes:
                    writes.append((kv.row, w_start, slots))
                kv.table_writes.clear()
            if n == 1:
                kv.append_slot(flat_slots[off])
            else:
                kv.slots = torch.cat((kv.slots, new_slots[off : off + n]))
            off += n
            rows.append(kv.row)
            prefix_lens.append(start)
            extend_lens.append(n)
            if end == seq_len and r.pool is None:
                sampled_idx.append(i)
            if end < seq_len - 1 or n > 1:
                prefill_tokens += n
        self.stats.prefill_tokens += prefill_tokens
        self.stats.decode_tokens += len(flat_slots) - prefill_tokens
        reqs = [r for r, _ in plan]
        sampled = [reqs[i] for i in sampled_idx]
        offsets = paths = None
        if layout is not None:
            offsets, paths = layout.offsets, layout.paths
            if len(sampled) > decoding:  # (prefills' picks)
                offsets = offsets + [0] * (len(sampled) - decoding)
                paths = paths + [[]] * (len(sampled) - decoding)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=new_slots,
            rows=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            table_writes=writes,
            write_new_slots=True,
            sample_indices=sampled_idx,
            sampling=self.sampling_batch(sampled, offsets, paths) if sampled else None,
            prompt_lp_pos=lp_pos,
            prompt_lp_target=lp_target,
            prompt_lp_top=lp_top,
            placeholder_pos=ph_pos,
            pool_pos=pool_pos,
            pool_row=pool_row,
            pool_rows=len(pool_reqs),
            trees=layout.trees if layout is not None else None,
        )
        if cascade_members and decoding == len(plan) >= 2 and not drafts:
            batch.shared = self.shared_prefixes(reqs, rows, cascade_members)
        return ScheduledStep(batch, reqs, sampled, placeholder_reqs=ph_req, prompt_lp_reqs=lp_reqs,
                             pool_reqs=pool_reqs)

    def shared_prefixes(self, reqs: list[Request], rows: list[int], members: int) -> cascade.SharedPrefixes | None:
        """Which requests of a decode batch read the same cached prefix (cascade decoding),
        at most ``members`` per item."""
        chains = []
        for r in reqs:
            kv = r.kv
            # (a chain has a slot per whole chunk of the cached prefix: a rolled-back decode
            # step can lower cached_len without replacing the slots)
            if kv.share_chain is None or len(kv.share_chain) != kv.cached_len // cascade.CHUNK:
                kv.share_chain = cascade.chain(kv.slots, kv.cached_len)
            chains.append(kv.share_chain)
        # while the same requests decode in the same order with the same chains and rows (step
        # after step), the plan is the same: compared at C speed (identity first), not rebuilt
        last = self._last_plan
        if last is not None and last[0] == reqs and last[1] == chains and last[2] == rows:
            return last[3]
        shared = cascade.plan(chains, rows, members)
        self._last_plan = (list(reqs), chains, list(rows), shared)
        return shared

    def sampling_batch(self, reqs: list[Request], offsets: list[int] | None = None,
                       paths: list[list[int]] | None = None) -> SamplingBatch:
        """The sampling inputs of ``reqs`` (the requests picking a token, in batch order;
        ``offsets``: each row's token index past ``len(output_ids)``, for verify rows, whose
        penalties count the drafted tokens before them, ``paths``)."""
        # The requests' constant inputs (each computed once per request, see
        # Request.sampling_row) are batched once and reused while the same requests sample in
        # the same order, as they do step after step while decoding; only the token index of
        # each row is new every step. The worker reads these tensors, never writes them.
        f32 = torch.float32
        cached = self._sampling_cache
        if cached is None or cached.reqs != reqs:
            cached = self._sampling_cache = _SamplingRows(reqs, self.max_top_logprobs)
        steps = [len(r.output_ids) for r in reqs]
        if offsets is not None:
            steps = [s + o for s, o in zip(steps, offsets, strict=True)]
        sb = SamplingBatch(
            temperature=cached.temperature,
            top_p=cached.top_p,
            top_k=cached.top_k,
            min_p=cached.min_p,
            seeds=cached.seeds,
            steps=torch.tensor(steps, dtype=torch.int64),
            top_logprobs=cached.top_logprobs,
            want_logprobs=cached.want_logprobs,
            all_greedy=cached.all_greedy,
        )
        if cached.penalties:
            ps = [r.params for r in reqs]
            sb.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], dtype=f32)
            sb.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], dtype=f32)
            sb.presence_penalty = torch.tensor([p.presence_penalty for p in ps], dtype=f32)
            out_rows, out_toks, rep_rows, rep_toks = [], [], [], []
            for i, r in enumerate(reqs):
                out = r.output_ids if not paths or not paths[i] else r.output_ids + paths[i]
                out_rows += [i] * len(out)
                out_toks += out
                if r.params.repetition_penalty != 1.0:
                    seen = sorted(set(r.prompt_ids) | set(out))
                    rep_rows += [i] * len(seen)
                    rep_toks += seen
            sb.penalty_rows = torch.tensor(out_rows, dtype=torch.int64)
            sb.penalty_tokens = torch.tensor(out_toks, dtype=torch.int64)
            if rep_rows:
                sb.rep_rows = torch.tensor(rep_rows, dtype=torch.int64)
                sb.rep_tokens = torch.tensor(rep_toks, dtype=torch.int64)
        if cached.bias_rows is not None:
            sb.bias_rows, sb.bias_tokens, sb.bias_values = cached.bias_rows, cached.bias_tokens, cached.bias_values
        if any(steps[i] < reqs[i].params.min_new_tokens for i in cached.min_new_rows):
            # min_new_tokens not reached: the stop tokens are banned this step
            banned_rows, banned_toks = [], []
            for i, r in enumerate(reqs):
                if steps[i] < r.params.min_new_tokens:
                    stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self.eos))
                    banned_rows += [i] * len(stops)
                    banned_toks += sorted(stops)
            if banned_rows:
                sb.banned_rows = torch.tensor(banned_rows, dtype=torch.int64)
                sb.banned_tokens = torch.tensor(banned_toks, dtype=torch.int64)
        if cached.constrained:
            self.constraints.add_masks(sb, reqs)
        return sb


class _SamplingRows:
    """The constant sampling inputs of a list of requests, batched (one tensor per dtype)."""

    def __init__(self, reqs: list[Request], max_top_logprobs: int):
        self.reqs = list(reqs)
        temps, top_ps, min_ps, top_ks, seeds = [], [], [], [], []
        self.top_logprobs = 0
        self.want_logprobs = self.penalties = self.constrained = False
        self.all_greedy = True
        self.min_new_rows = []  # rows whose stop tokens may be banned (min_new_tokens)
        for i, r in enumerate(reqs):
            row = r.sampling_row
            if row is None:
                row = r.sampling_row = _sampling_row(r.params, max_top_logprobs)
            temp, top_p, min_p, top_k, greedy, lp, top_lp, pen = row
            temps.append(temp)
            top_ps.append(top_p)
            min_ps.append(min_p)
            top_ks.append(top_k)
            seeds.append(r.seed)
            self.all_greedy = self.all_greedy and greedy
            self.want_logprobs = self.want_logprobs or lp
            self.top_logprobs = max(self.top_logprobs, top_lp)
            self.penalties = self.penalties or pen
            self.constrained = self.constrained or r.matcher is not None
            if r.params.min_new_tokens > 0:
                self.min_new_rows.append(i)
        bias = [(i, tok, value) for i, r in enumerate(reqs) for tok, value in (r.params.logit_bias or {}).items()]
        self.bias_rows = self.bias_tokens = self.bias_values = None
        if bias:
            rows, toks, values = zip(*bias, strict=True)
            self.bias_rows = torch.tensor(rows, dtype=torch.int64)
            self.bias_tokens = torch.tensor(toks, dtype=torch.int64)
            self.bias_values = torch.tensor(values, dtype=torch.float32)
        fl = torch.tensor([temps, top_ps, min_ps], dtype=torch.float32)
        it = torch.tensor([top_ks, seeds], dtype=torch.int64)
        self.temperature, self.top_p, self.min_p = fl[0], fl[1], fl[2]
        self.top_k, self.seeds = it[0], it[1]


def _sampling_row(p, max_top_logprobs: int) -> tuple:
    """A request's constant sampling inputs: (temperature (0 = greedy), top_p, min_p, top_k
    (0 = off), greedy, logprobs, top logprobs (capped), penalties)."""
    return (0.0 if p.greedy else p.temperature, p.top_p, p.min_p, max(p.top_k, 0), p.greedy, p.logprobs,
            min(p.top_logprobs, max_top_logprobs), p.needs_penalties)
