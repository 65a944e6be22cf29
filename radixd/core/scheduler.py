"""Continuous batching: which tokens of which requests run in the next forward pass.

Each step builds one mixed batch: every running request that has finished its prompt decodes
one token, a request in the middle of a chunked prefill gets its next chunk, and waiting
requests are admitted (in the policy's order) while the step's token budget, the running
limit and KV memory allow. When decode needs KV that neither the free list nor cache eviction
can give, the most recently arrived running request is preempted: its KV goes back (into the
radix cache when enabled) and it waits to resume with its generated tokens kept.

With lower cache tiers (``KVHierarchy``), a prefix match that continues past the pool loads
those pages back into fresh slots at admission; pages are stored on eviction (write-back) or
when a request leaves (write-through, or once its prefix was hit N times), per the config.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from radixd.core import cascade
from radixd.core.config import EngineConfig
from radixd.core.forward_batch import ForwardBatch, SamplingBatch, StepOutput
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.policy import PolicyContext, SchedulePolicy
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request, State
from radixd.core.tiers.hierarchy import KVHierarchy

PLACEHOLDER = -1  # a generated token whose value is still on the device


@dataclass
class ScheduledStep:
    batch: ForwardBatch
    reqs: list[Request]          # in batch order
    sampled: list[Request]       # requests that pick a token this step (batch.sample_indices)
    pick_index: list[int] = field(default_factory=list)  # where each pick goes in output_ids
    placeholder_reqs: list[Request] = field(default_factory=list)  # inputs pending on the device
    prompt_lp_reqs: list[tuple[Request, int]] = field(default_factory=list)  # prompt logprobs each gets
    step_ms: float = 0.0         # wall time of the step, set by the engine once it ran


NEED_SYNC = object()  # schedule(): resolve the launched step first, then ask again

@dataclass
class SchedulerStats:
    preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    tier_loaded_tokens: int = 0   # prompt tokens loaded from lower tiers instead of computed


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        *,
        allocator: SlotAllocator,
        rows: RowAllocator,
        cache: RadixCache,
        policy: SchedulePolicy,
        eos_token_ids: tuple[int, ...],
        context_len: int,
        tiers: KVHierarchy | None = None,
        vocab_size: int | None = None,
        cascade_members: int = 0,
    ):
        self.config = config
        self.allocator = allocator
        self.rows = rows
        self.cache = cache
        self.policy = policy
        self.eos = tuple(eos_token_ids)
        self.context_len = context_len
        self.vocab_size = vocab_size  # the logits' width (grammar masks)
        self.reserve_ratio = config.schedule_conservativeness
        # Requests per shared-prefix item of a decode batch; 0: no cascade plan (the worker's
        # attention backend says how many when it decodes in cascade).
        self.cascade_members = cascade_members
        self._last_plan: tuple | None = None  # (requests, chains, rows, plan) of the last decode step
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._dropped: list[Request] = []  # aborted and removed, not yet reported (take_dropped)
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()
        self.tiers = tiers
        self._load_events: list = []  # CUDA events of tier loads the next step must wait for
        self._sampling_cache: _SamplingRows | None = None  # the last step's batched sampling rows
        if tiers is not None and tiers.write_policy == "write_back":
            cache.on_evict = self._store_path

    # ------------------------------------------------------------------ queue

    def next_arrival(self) -> int:
        return next(self._arrivals)

    def add(self, req: Request) -> None:
        req.state = State.WAITING
        self.waiting.append(req)
        if self.tiers is not None and req.namespace == 0 and req.preemptions == 0:
            self.tiers.prefetch(req.seq, self.cache.peek_prefix_len(req.seq, 0))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Mark for abort; the request leaves at the next step boundary."""
        req.aborted = True

    # ------------------------------------------------------------------ one step

    def take_dropped(self) -> list[Request]:
        """Requests aborted and removed since the last call (their consumers must be told)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def schedule(self, launched: ScheduledStep | None = None) -> ScheduledStep | None:
        """The next batch. ``launched``: a step whose picks are not back yet (overlap
        scheduling); its requests' last token is a placeholder the worker fills in on the
        device from that step's picks (``batch.placeholder_src``). Returns ``NEED_SYNC`` when
        that step must be resolved first (a preemption, or penalties that need the pending
        token)."""
        inflight = frozenset(launched.reqs) if launched is not None else frozenset()
        self._drop_aborted(inflight)
        plan: list[tuple[Request, int]] = []   # (request, tokens to run)
        budget = self.config.max_prefill_tokens

        # 1. Decode for every running request past its prompt; preempt if KV runs out.
        decoding: list[Request] = []
        mid_prefill = False  # a running request has prompt chunks left
        host_picks = False   # a decoding request needs its pending pick on the host (penalties)
        ctx_len = self.context_len
        for r in self.running:
            out_len = len(r.output_ids)
            last = len(r.prompt_ids) + out_len - 1
            if r.kv_len == last:
                # _may_continue, inlined (this runs for every request every step)
                if (r.finish_reason is None and not r.aborted and out_len < r.params.max_new_tokens
                        and last + 1 < ctx_len):
                    decoding.append(r)
                    if r.unresolved and r.params.needs_penalties:
                        host_picks = True
            elif r.kv_len < last:
                mid_prefill = True
        if inflight and host_picks:
            return NEED_SYNC  # penalties need the pending token on the host (grammar masks
                             # are filled while the step runs: see _sampling_batch)
        while decoding and not self._make_room(len(decoding)):
            if inflight:
                return NEED_SYNC
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim)
            decoding = [r for r in decoding if r is not victim]
        plan.extend((r, 1) for r in decoding)
        planned = len(decoding)  # tokens in the plan so far

        # 2. Continue chunked prefills (a smaller chunk if memory is short).
        if mid_prefill:
            for r in self.running:
                if r.kv_len < r.seq_len - 1 and budget > 0 and not r.aborted:
                    want = min(r.seq_len - r.kv_len, budget, self.config.chunked_prefill_size)
                    n = self._room_for(want, planned=planned)
                    if n == 0:
                        break
                    plan.append((r, n))
                    budget -= n
                    planned += n

        # 3. Admit waiting requests in the policy's order.
        # (no room for another request: the policy's ranking, which can walk every waiting
        # prompt, would be thrown away)
        room = self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests
        ready = [r for r in self.waiting if not self._blocked(r)] if room else []
        if ready:
            # requests computing prompt tokens this step (their final chunk included): later
            # requests sharing those tokens should wait a step and read them from the cache
            prefilling = [r for r, n in plan if n > 1 or r.kv_len + n < r.seq_len]
            ctx = PolicyContext(cache=self.cache, prefilling=prefilling)
            for r in self.policy.order(ready, ctx):
                if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                    break
                n = self._admit(r, budget, planned=planned)
                if n is None:
                    break
                plan.append((r, n))
                budget -= n
                planned += n

        if not plan:
            if inflight:
                return None  # the launched step's results decide what comes next
            if any(r.finish_reason is None and r.kv_len < r.seq_len - 1 for r in self.running):
                # Everything running is stuck mid-prefill without memory: make one give way.
                self._preempt(max(self.running, key=lambda r: r.arrival))
                return self.schedule()
            return None
        step = self._build(plan, decoding=len(decoding))
        if step.placeholder_reqs:  # where each placeholder's value is among the launched picks
            src = {r: i for i, r in enumerate(launched.sampled)}
            step.batch.placeholder_src = [src[r] for r in step.placeholder_reqs]
        return step

    def _may_continue(self, r: Request) -> bool:
        """False once ``r`` has (or will have, counting its pending pick) all its tokens."""
        return (r.finish_reason is None and not r.aborted and len(r.output_ids) < r.params.max_new_tokens
                and r.seq_len < self.context_len)

    def _blocked(self, r: Request) -> bool:
        """A follower of an ``n > 1`` call waits until its leader's prompt is cached."""
        g = r.group
        return r.is_follower and g is not None and g.prompt_node is None and not g.leader_gone

    def _admit(self, r: Request, budget: int, planned: int) -> int | None:
        """Give ``r`` a table row, its cached prefix and slots for its first chunk."""
        if self.rows.available == 0:
            return None
        seq = r.seq
        limit = len(seq) - 1
        missing = r.prompt_lp_missing
        if missing is not None:  # the logits before each wanted prompt token must be computed
            limit = min(limit, missing - 1)
        match = self.cache.match_prefix(seq[:limit], r.namespace)
        self.cache.lock(match.node)
        if self.tiers is not None and r.namespace == 0:
            match = self._load_from_tiers(seq, match, planned, limit)
        hit = match.slots.numel()
        n = min(len(seq) - hit, budget, self.config.chunked_prefill_size)
        reserve = self._reserve() + math.ceil(r.remaining_new_tokens * self.reserve_ratio)
        if not self._make_room(planned + n, keep=reserve + (len(seq) - hit - n)):
            self.cache.unlock(match.node)
            return None
        r.row = self.rows.alloc()
        r.slots = match.slots
        r.kv_len = r.cached_len = hit
        r.last_node = match.node
        r.table_writes.append((0, match.slots))
        if r.cached_tokens is None:
            r.cached_tokens = min(hit, len(r.prompt_ids))
            self.cache.record_query(len(r.prompt_ids), r.cached_tokens)
            self.cache.count_hit(match.node)
        if r.is_follower and r.group is not None:
            r.group.followers_waiting -= 1
            if r.group.followers_waiting == 0 and r.group.prompt_node is not None:
                self.cache.unlock(r.group.prompt_node)
        self.waiting.remove(r)
        self.running.append(r)
        r.state = State.RUNNING
        return n

    def _reserve(self) -> int:
        """KV to keep free for the running requests' remaining tokens (an estimate)."""
        total = 0
        for r in self.running:
            total += (r.seq_len - 1 - r.kv_len) + math.ceil(r.remaining_new_tokens * self.reserve_ratio)
        return total

    def _room_for(self, want: int, planned: int) -> int:
        """How many of ``want`` slots can be had on top of ``planned`` (evicting if needed)."""
        if self._make_room(planned + want):
            return want
        return max(0, min(want, self.allocator.available - planned))

    def _make_room(self, n: int, keep: int = 0) -> bool:
        """True if ``n`` slots (plus ``keep`` spare) are free, evicting cached KV if needed.
        Slots are taken later, in ``_build``."""
        want = n + keep
        if self.allocator.available < want:
            self.cache.evict(want - self.allocator.available)
        return self.allocator.available >= want

    def _build(self, plan: list[tuple[Request, int]], decoding: int = 0) -> ScheduledStep:
        """The step's batch. ``plan[:decoding]`` are decodes: requests whose last token is
        all they run (the common case, built on a shorter path)."""
        # Flat Python lists, one torch.tensor call each at the end: this loop runs for every
        # request every step, so it does no tensor work per request (a decode step's slot is
        # kept as an int, see Request.append_slot).
        ids: list[int] = []
        pos: list[int] = []
        rows, prefix_lens, extend_lens, writes = [], [], [], []
        sampled_idx: list[int] = []
        total = sum(n for _, n in plan)
        new_slots = self.allocator.alloc(total)
        assert new_slots is not None, "scheduler: room was checked before building"
        flat_slots = new_slots.tolist()
        off = 0
        prefill_tokens = 0
        ph_pos: list[int] = []
        ph_req: list[Request] = []
        lp_pos: list[int] = []
        lp_target: list[int] = []
        lp_reqs: list[tuple[Request, int]] = []
        if decoding:  # the plan starts with them: one token each, the last of their sequence
            dec = [r for r, _ in plan[:decoding]]
            ids = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in dec]
            ids = [0 if t == PLACEHOLDER else t for t in ids]
            pos = [r.kv_len for r in dec]
            rows = [r.row for r in dec]
            prefix_lens = pos.copy()
            extend_lens = [1] * decoding
            sampled_idx = list(range(decoding))
            for i, r in enumerate(dec):
                if r.unresolved:
                    ph_pos.append(i)
                    ph_req.append(r)
                if r.table_writes:
                    for start, slots in r.table_writes:
                        writes.append((r.row, start, slots))
                    r.table_writes.clear()
                r.append_slot(flat_slots[i])
            off = decoding
        for i, (r, n) in enumerate(plan[decoding:], start=decoding):
            kv = r.kv_len
            prompt = r.prompt_ids
            plen = len(prompt)
            seq_len = plen + len(r.output_ids)
            end = kv + n
            if r.params.prompt_logprobs_from is not None and (missing := r.prompt_lp_missing) is not None:
                # positions q of this chunk whose logits predict prompt[q + 1]
                qs = range(max(kv, missing - 1), min(end, plen - 1))
                lp_pos.extend(len(ids) + q - kv for q in qs)
                lp_target.extend(prompt[q + 1] for q in qs)
                if qs:
                    lp_reqs.append((r, len(qs)))
            if r.unresolved and end == seq_len:  # its last token is a pending pick
                ph_pos.append(len(ids) + n - 1)
                ph_req.append(r)
            if n == 1:
                tok = r.output_ids[kv - plen] if kv >= plen else prompt[kv]
                ids.append(0 if tok == PLACEHOLDER else tok)
                pos.append(kv)
            else:
                ids.extend(0 if t == PLACEHOLDER else t for t in r.tokens(kv, end))
                pos.extend(range(kv, end))
            if r.table_writes:
                for start, slots in r.table_writes:
                    writes.append((r.row, start, slots))
                r.table_writes.clear()
            if n == 1:
                r.append_slot(flat_slots[off])
            else:
                r.slots = torch.cat((r.slots, new_slots[off : off + n]))
            off += n
            rows.append(r.row)
            prefix_lens.append(kv)
            extend_lens.append(n)
            if end == seq_len:
                sampled_idx.append(i)
            if end < seq_len - 1 or n > 1:
                prefill_tokens += n
        self.stats.prefill_tokens += prefill_tokens
        self.stats.decode_tokens += total - prefill_tokens
        reqs = [r for r, _ in plan]
        sampled = [reqs[i] for i in sampled_idx]
        sampling = self._sampling_batch(sampled) if sampled else None
        # The step is committed: its KV positions count as computed from now on (the device
        # runs steps in order, so a later step may read them), and each pick gets a place.
        slots_of: list[int] = []
        for r, n in plan:
            r.kv_len += n
            if n > 1:
                self._cache_progress(r)  # a prefill chunk: share it with later requests now
        for r in sampled:
            g = r.group
            if g is not None and r.index == 0 and g.prompt_node is None and g.followers_waiting > 0:
                g.prompt_node = r.last_node  # the leader's prompt is cached: followers may go
                self.cache.lock(g.prompt_node)
            r.output_ids.append(PLACEHOLDER)
            r.unresolved += 1
            slots_of.append(len(r.output_ids) - 1)
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
            sampling=sampling,
            prompt_lp_pos=lp_pos,
            prompt_lp_target=lp_target,
        )
        if self.cascade_members and decoding == len(plan) >= 2:
            batch.shared = self._shared_prefixes(reqs, rows)
        batch.wait_events, self._load_events = self._load_events, []
        self.stats.steps += 1
        step = ScheduledStep(batch, reqs, sampled, pick_index=slots_of)
        step.placeholder_reqs = ph_req
        step.prompt_lp_reqs = lp_reqs
        batch.placeholder_pos = ph_pos
        return step

    def _shared_prefixes(self, reqs: list[Request], rows: list[int]) -> cascade.SharedPrefixes | None:
        """Which requests of a decode batch read the same cached prefix (cascade decoding)."""
        chains = []
        for r in reqs:
            # (a chain has a slot per whole chunk of the cached prefix: a rolled-back decode
            # step can lower cached_len without replacing the slots)
            if r.share_chain is None or len(r.share_chain) != r.cached_len // cascade.CHUNK:
                r.share_chain = cascade.chain(r.slots, r.cached_len)
            chains.append(r.share_chain)
        # while the same requests decode in the same order with the same chains and rows (step
        # after step), the plan is the same: compared at C speed (identity first), not rebuilt
        last = self._last_plan
        if last is not None and last[0] == reqs and last[1] == chains and last[2] == rows:
            return last[3]
        shared = cascade.plan(chains, rows, self.cascade_members)
        self._last_plan = (list(reqs), chains, list(rows), shared)
        return shared

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        # The requests' constant inputs (each computed once per request, see
        # Request.sampling_row) are batched once and reused while the same requests sample in
        # the same order, as they do step after step while decoding; only the token index of
        # each row is new every step. The worker reads these tensors, never writes them.
        f32 = torch.float32
        cached = self._sampling_cache
        if cached is None or cached.reqs != reqs:
            cached = self._sampling_cache = _SamplingRows(reqs, self.config.max_top_logprobs)
        steps = [len(r.output_ids) for r in reqs]
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
        penalties, constrained = cached.penalties, cached.constrained
        banned = any(steps[i] < reqs[i].params.min_new_tokens for i in cached.min_new_rows)
        if penalties:
            ps = [r.params for r in reqs]
            sb.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], dtype=f32)
            sb.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], dtype=f32)
            sb.presence_penalty = torch.tensor([p.presence_penalty for p in ps], dtype=f32)
            out_rows, out_toks, rep_rows, rep_toks = [], [], [], []
            for i, r in enumerate(reqs):
                out_rows += [i] * len(r.output_ids)
                out_toks += r.output_ids
                if r.params.repetition_penalty != 1.0:
                    seen = sorted(set(r.seq))
                    rep_rows += [i] * len(seen)
                    rep_toks += seen
            sb.penalty_rows = torch.tensor(out_rows, dtype=torch.int64)
            sb.penalty_tokens = torch.tensor(out_toks, dtype=torch.int64)
            if rep_rows:
                sb.rep_rows = torch.tensor(rep_rows, dtype=torch.int64)
                sb.rep_tokens = torch.tensor(rep_toks, dtype=torch.int64)
        if banned:
            banned_rows, banned_toks = [], []
            for i, r in enumerate(reqs):
                if len(r.output_ids) < r.params.min_new_tokens:
                    stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self.eos))
                    banned_rows += [i] * len(stops)
                    banned_toks += sorted(stops)
            if banned_rows:
                sb.banned_rows = torch.tensor(banned_rows, dtype=torch.int64)
                sb.banned_tokens = torch.tensor(banned_toks, dtype=torch.int64)
        if constrained:
            rows = [(i, r) for i, r in enumerate(reqs) if r.matcher is not None]
            if any(r.unresolved for _, r in rows):
                # A matcher still waits for its last token (overlap): the engine fills the
                # masks once that step is read, while this step's forward runs; the sampler
                # waits for them (``allowed_future``).
                sb.deferred_masks = rows
                sb.allowed_future = concurrent.futures.Future()
            else:
                sb.allowed = torch.from_numpy(self.fill_masks(len(reqs), rows))
        return sb

    def fill_masks(self, rows: int, constrained: list) -> np.ndarray:
        """[rows, vocab] bool: each constrained row's grammar mask, the others all True (and
        so are rows of requests that finished meanwhile: their picks are dropped)."""
        allowed = np.ones((rows, self.vocab_size), dtype=bool)
        close = self.config.grammar_close_within_max_tokens
        for i, r in constrained:
            if r.finish_reason is None:
                within = getattr(r.matcher, "fill_mask_within", None) if close else None
                if within is None:
                    r.matcher.fill_mask(allowed[i])
                else:  # only tokens after which the document still closes in time
                    within(allowed[i], self.tokens_left(r))
        return allowed

    def tokens_left(self, r: Request) -> int:
        """Tokens ``r`` may still generate, the one being sampled included (its matcher has
        accepted every earlier one: masks are filled once the tokens before are known)."""
        return min(r.params.max_new_tokens, self.context_len - len(r.prompt_ids)) - r.num_output

    # ------------------------------------------------------------------ results

    def process(self, step: ScheduledStep, out: StepOutput) -> list[int]:
        """Put the step's picks in place of their placeholders and mark token-level finishes.

        A request that finished while this step was in flight gets no token from it: its
        placeholder is dropped (the KV the step computed is for tokens it already has)."""
        off = 0
        for r, k in step.prompt_lp_reqs:
            r.prompt_logprobs.extend(out.prompt_logprobs[off : off + k])
            off += k
        accepted = []
        eos, ctx_len = self.eos, self.context_len
        for i, (r, idx, tok) in enumerate(zip(step.sampled, step.pick_index, out.next_tokens, strict=True)):
            r.unresolved -= 1
            if r.finish_reason is not None:
                assert idx == len(r.output_ids) - 1
                r.output_ids.pop()
                continue
            r.output_ids[idx] = tok
            # the finish reason after the count-th generated token, if any
            p, count = r.params, idx + 1
            if count >= p.min_new_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
                r.finish("stop")
            elif count >= p.max_new_tokens or len(r.prompt_ids) + count >= ctx_len:
                r.finish("length")
            if r.matcher is not None:
                if not r.matcher.accept_token(tok):  # the mask allowed it: a backend bug
                    r.finish("abort")
                elif r.finish_reason in (None, "length") and r.matcher.is_terminated():
                    r.finish("stop")  # the grammar is complete: nothing else may follow
            accepted.append(i)
        return accepted  # indices into step.sampled of the picks that count

    def rollback(self, step: ScheduledStep) -> None:
        """A launched step failed: forget what it would have computed (its KV is not valid).

        Prefill chunks went into the radix cache when the step was built: each such request
        moves its lock back to where its valid KV ends, and the tree drops the nodes past
        it that nobody else holds (their slots go back to the free list)."""
        uncached = []
        for r, n in zip(step.reqs, step.batch.extend_lens, strict=True):
            r.kv_len -= n
            r.cached_len = min(r.cached_len, r.kv_len)
            if n > 1 and r.last_node is not None:
                uncached.append((r, r.last_node))
                g = r.group
                if g is not None and g.prompt_node is r.last_node:  # set by this step: not valid
                    self.cache.unlock(g.prompt_node)
                    g.prompt_node = None
                    g.leader_gone = True  # the followers compute the prompt themselves
                match = self.cache.match_prefix(r.seq[: r.kv_len], r.namespace)
                self.cache.lock(match.node)
                self.cache.unlock(r.last_node)
                r.slots, r.last_node = match.slots, match.node
                r.table_writes = [(0, match.slots)]  # the table row is rewritten on resume
        for r, invalid in uncached:
            self.cache.drop_unlocked_path(invalid, stop=r.last_node)
        for r, idx in zip(step.sampled, step.pick_index, strict=True):
            r.unresolved -= 1
            del r.output_ids[idx]

    def release_finished(self, inflight: frozenset[Request] = frozenset()) -> list[Request]:
        """Release the KV of finished requests (not those a launched step still writes for)."""
        done = [r for r in self.running if r.finish_reason is not None and r not in inflight]
        if not done:
            return done
        for r in done:
            self._release(r)
            r.state = State.FINISHED
        gone = set(done)
        self.running[:] = [r for r in self.running if r not in gone]  # one pass, not a remove each
        return done

    # ------------------------------------------------------------------ KV hand-over

    def _cache_progress(self, r: Request) -> None:
        """Move ``r``'s computed KV into the radix tree and pin it with ``r``'s lock."""
        key = r.seq[: r.kv_len]
        existing = self.cache.insert(key, r.slots[: r.kv_len], r.namespace)
        if existing > r.cached_len:
            # Someone cached these tokens meanwhile: drop our copies, read theirs.
            self.allocator.free(r.slots[r.cached_len : existing])
        match = self.cache.match_prefix(key, r.namespace)
        self.cache.lock(match.node)
        if r.last_node is not None:
            self.cache.unlock(r.last_node)
        if existing > r.cached_len:
            r.table_writes.append((r.cached_len, match.slots[r.cached_len : existing]))
        r.slots = match.slots
        r.cached_len = r.kv_len
        r.last_node = match.node

    def _release(self, r: Request) -> None:
        if r.row is None:
            return
        if r.slots.numel() > r.kv_len:  # slots of a step that never completed
            self.allocator.free(r.slots[r.kv_len :])
            r.slots = r.slots[: r.kv_len]
        self._cache_progress(r)
        if self.tiers is not None and r.namespace == 0:
            self._write_through(r.last_node)
        self.cache.unlock(r.last_node)
        self.rows.free(r.row)
        r.row = None
        r.last_node = None
        r.slots = torch.empty(0, dtype=torch.int64)
        r.kv_len = r.cached_len = 0
        r.table_writes.clear()

    def _preempt(self, r: Request) -> None:
        self._release(r)
        self.running.remove(r)
        r.preemptions += 1
        self.stats.preemptions += 1
        self.add(r)

    def _drop_aborted(self, inflight: frozenset[Request] = frozenset()) -> None:
        for r in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(r)
            self._leave_group(r)
            r.finish("abort")
            r.state = State.FINISHED
            self._dropped.append(r)
        for r in [r for r in self.running if r.aborted and r not in inflight]:
            if r.group is not None and not r.is_follower:
                r.group.leader_gone = True
            self._release(r)
            self.running.remove(r)
            r.finish("abort")
            r.state = State.FINISHED
            self._dropped.append(r)

    def _leave_group(self, r: Request) -> None:
        g = r.group
        if g is not None and not r.is_follower:
            g.leader_gone = True
        if g is not None and r.is_follower:
            g.followers_waiting -= 1
            if g.followers_waiting == 0 and g.prompt_node is not None:
                self.cache.unlock(g.prompt_node)

    # ------------------------------------------------------------------ lower tiers

    def _load_from_tiers(self, seq: list[int], match, planned: int, limit: int):
        """Extend a locked pool ``match`` of ``seq`` with pages loaded from the lower tiers
        (up to ``limit`` tokens; into fresh slots, inserted into the tree, locked instead of
        ``match``)."""
        hit = match.slots.numel()
        first, plan = self.tiers.plan_load(seq, hit, limit)
        if not plan:
            return match
        p = self.tiers.page_tokens
        skip = hit - first * p
        want = len(plan) * p - skip
        if not self._make_room(planned + want):
            fit = self.allocator.available - planned
            plan = plan[: max(0, (fit + skip) // p)]
            want = len(plan) * p - skip
            if want <= 0:
                return match
        slots = self.allocator.alloc(want)
        assert slots is not None, "scheduler: room was made for the tier load"
        n, event = self.tiers.load(plan, slots, skip)
        if n < want:
            self.allocator.free(slots[n:])
        if n <= 0:
            return match
        if event is not None:
            self._load_events.append(event)
        key = seq[: hit + n]
        existing = self.cache.insert(key, torch.cat((match.slots, slots[:n])), 0)
        if existing > hit:  # cannot happen while match.node is locked; stay correct anyway
            self.allocator.free(slots[: existing - hit])
        loaded = self.cache.match_prefix(key, 0)
        self.cache.lock(loaded.node)
        self.cache.unlock(match.node)
        node = loaded.node
        while node is not match.node and not node.is_root:
            node.backed = True  # its pages came from the tiers
            node = node.parent
        self.stats.tier_loaded_tokens += n
        return loaded

    def _write_through(self, node) -> None:
        """A request left with ``node`` the end of its KV: store per the write policy."""
        policy = self.tiers.write_policy
        if policy == "write_through":
            self._store_path(node)
        elif policy == "write_through_hits":
            while not node.is_root and node.hits < self.tiers.write_hits:
                node = node.parent
            if not node.is_root:
                self._store_path(node)

    def _store_path(self, node) -> None:
        """Store the pages of the path to ``node`` from its first node not yet backed. Every
        node in the tree that no running request still computes has its KV (the callers:
        release and eviction of unlocked leaves)."""
        path = self.cache.path(node)
        i = start = 0
        while i < len(path) and path[i].backed:
            start += len(path[i].key)
            i += 1
        if i == len(path):
            return
        tokens = [t for n in path for t in n.key]
        slots = torch.cat([n.value for n in path])
        self.tiers.store(tokens, slots, start, len(tokens))
        for n in path[i:]:
            n.backed = True

    # ------------------------------------------------------------------ accounting

    def accounting(self) -> dict[str, int]:
        """free + evictable + locked + private == total, recounted from the parts."""
        private = sum(r.private_len for r in self.running)
        return {
            "total": self.allocator.total,
            "free": self.allocator.available,
            "evictable": self.cache.evictable_size,
            "locked": self.cache.protected_size,
            "private": private,
        }

    def check_accounting(self) -> None:
        a = self.accounting()
        if a["free"] + a["evictable"] + a["locked"] + a["private"] != a["total"]:
            raise AssertionError(f"KV accounting broken: {a}")
        self.cache.check()
        every = torch.cat(
            [self.allocator.free_slots(), self.cache.all_slots()]
            + [r.slots[r.cached_len : r.kv_len] for r in self.running]
        )
        if every.numel() != a["total"] or torch.unique(every).numel() != a["total"]:
            raise AssertionError("KV slots are lost or owned twice")


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
        fl = torch.tensor([temps, top_ps, min_ps], dtype=torch.float32)
        it = torch.tensor([top_ks, seeds], dtype=torch.int64)
        self.temperature, self.top_p, self.min_p = fl[0], fl[1], fl[2]
        self.top_k, self.seeds = it[0], it[1]


def _sampling_row(p, max_top_logprobs: int) -> tuple:
    """A request's constant sampling inputs: (temperature (0 = greedy), top_p, min_p, top_k
    (0 = off), greedy, logprobs, top logprobs (capped), penalties)."""
    return (0.0 if p.greedy else p.temperature, p.top_p, p.min_p, max(p.top_k, 0), p.greedy, p.logprobs,
            min(p.top_logprobs, max_top_logprobs), p.needs_penalties)
