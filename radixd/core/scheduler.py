"""Continuous batching: which tokens of which requests run in the next forward pass.

Each step builds one mixed batch: every running request that has finished its prompt decodes
one token, a request in the middle of a chunked prefill gets its next chunk, and waiting
requests are admitted (in the policy's order) while the step's token budget, the running
limit and KV memory allow. When decode needs KV that neither the free list nor cache eviction
can give, the most recently arrived running request is preempted: its KV goes back (into the
radix cache when enabled) and it waits to resume with its generated tokens kept.

The scheduler decides and keeps the queues; its rooms do the rest: the KV manager
(``kv_manager``) owns memory, the batch builder (``batch_builder``) lays a plan out as a
``ForwardBatch``, and ``constraints`` fills grammar masks and feeds the matchers. The
interface the engine codes against, with the overlap-scheduling rules, is
``scheduler_interface.SchedulerInterface``.
"""

from __future__ import annotations

import itertools

import numpy as np

from radixd.core import constraints, pooling
from radixd.core.batch_builder import BatchBuilder
from radixd.core.config import EngineConfig
from radixd.core.forward_batch import StepOutput
from radixd.core.kv_manager import KVManager
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.policy import PolicyContext, SchedulePolicy
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request, State
from radixd.core.scheduler_interface import (
    NEED_SYNC,
    PLACEHOLDER,
    ScheduledStep,
    SchedulerInterface,
    SchedulerStats,
)
from radixd.core.speculative.drafter import Drafter
from radixd.core.speculative.speculator import Speculator
from radixd.core.tiers.hierarchy import KVHierarchy

__all__ = ["NEED_SYNC", "PLACEHOLDER", "ScheduledStep", "Scheduler", "SchedulerInterface", "SchedulerStats"]


class Scheduler(SchedulerInterface):
    """The replica's scheduler (``SchedulerInterface``'s docstrings are the contract)."""

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
        drafter: Drafter | None = None,
    ):
        self.config = config
        self.cache = cache
        self.policy = policy
        self.eos = tuple(eos_token_ids)
        self.context_len = context_len
        # Requests per shared-prefix item of a decode batch; 0: no cascade plan (the worker's
        # attention backend says how many when it decodes in cascade).
        self.cascade_members = cascade_members
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._dropped: list[Request] = []  # aborted and removed, not yet reported (take_dropped)
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()
        self.kv_manager = KVManager(config, allocator=allocator, rows=rows, cache=cache, tiers=tiers, stats=self.stats)
        self.constraints = constraints.Constraints(vocab_size=vocab_size, context_len=context_len,
                                                   close_within=config.grammar_close_within_max_tokens)
        self.builder = BatchBuilder(eos_token_ids=self.eos, max_top_logprobs=config.max_top_logprobs,
                                    constraints=self.constraints, stats=self.stats)
        self.speculator = (Speculator(config, drafter, self.kv_manager, self.constraints, context_len=context_len)
                           if drafter is not None else None)

    # ------------------------------------------------------------------ queue

    def next_arrival(self) -> int:
        return next(self._arrivals)

    def add(self, req: Request) -> None:
        req.state = State.WAITING
        self.waiting.append(req)
        self.kv_manager.prefetch(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        req.aborted = True

    def take_dropped(self) -> list[Request]:
        dropped, self._dropped = self._dropped, []
        return dropped

    # ------------------------------------------------------------------ one step

    def schedule(self, launched: ScheduledStep | None = None) -> ScheduledStep | None | object:
        inflight = frozenset(launched.reqs) if launched is not None else frozenset()
        self._drop_aborted(inflight)
        if inflight and launched.drafts:
            return NEED_SYNC  # where its requests' next tokens go depends on what it accepts

        # 1. Decode for every running request past its prompt; preempt if KV runs out.
        self.kv_manager.free_behind_windows(self.running)
        decoding, mid_prefill, host_picks = self._decoding()
        if inflight and host_picks:
            return NEED_SYNC  # penalties need the pending token on the host (grammar masks
                              # are filled while the step runs: see constraints)
        drafts = self.speculator.draft(decoding, bool(inflight)) if self.speculator is not None else {}
        if drafts is NEED_SYNC:
            return NEED_SYNC  # a request would draft: its tokens and masks must be on the host
        drafted = sum(map(len, drafts.values()))
        if drafted and not self.kv_manager.make_room(len(decoding) + drafted):
            drafts = {}  # speculation is optional: no KV for it, no drafts
        while decoding and not self.kv_manager.make_room(len(decoding)):
            if inflight:
                return NEED_SYNC
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim)
            decoding = [r for r in decoding if r is not victim]
        plan: list[tuple[Request, int]] = [(r, 1) for r in decoding if r not in drafts]  # (request, tokens)
        for r, d in drafts.items():  # verify entries: one decode row per position (last token, drafts)
            plan += [(r, 1)] * (1 + len(d))
        decodes = len(plan)
        budget = self.config.max_prefill_tokens
        if decodes and self.config.mixed_prefill_tokens:
            budget = min(budget, self.config.mixed_prefill_tokens)
        start = budget

        # 2. Continue chunked prefills (a smaller chunk if memory is short).
        if mid_prefill:
            budget = self._continue_prefills(plan, budget)

        # 3. Admit waiting requests in the policy's order.
        budget = self._admit_waiting(plan, decodes, budget, start)

        if not plan:
            if inflight:
                return None  # the launched step's results decide what comes next
            if any(r.finish_reason is None and r.prefilling for r in self.running):
                # Everything running is stuck mid-prefill without memory: make one give way.
                self._preempt(max(self.running, key=lambda r: r.arrival))
                return self.schedule()
            return None

        # 4. Build the batch and commit the step: its KV counts as computed, each pick gets a
        # placeholder, and each placeholder it reads says where among the launched picks it is.
        # (tokens planned: one per decode, and what prefills took of the budget)
        planned = decodes + start - budget
        step = self.builder.build(plan, decodes, self.kv_manager.alloc(planned), self.cascade_members, drafts)
        step.batch.window_map = self.kv_manager.take_window_map()  # (before commit: see swa_pool)
        step.drafts = drafts
        if drafts:
            self.speculator.constrain(step)
        self.kv_manager.commit(plan)
        picks = step.pick_index
        for r in step.sampled:
            picks.append(len(r.output_ids))
            r.output_ids.append(PLACEHOLDER)
            r.unresolved += 1
        step.batch.wait_events = self.kv_manager.take_load_events()
        self.stats.steps += 1
        if step.placeholder_reqs:
            src = {r: i for i, r in enumerate(launched.sampled)}
            step.batch.placeholder_src = [src[r] for r in step.placeholder_reqs]
        return step

    def _decoding(self) -> tuple[list[Request], bool, bool]:
        """The running requests that decode this step; whether one has prompt chunks left;
        whether one needs its pending pick on the host (penalties)."""
        decoding: list[Request] = []
        mid_prefill = host_picks = False
        ctx_len = self.context_len
        for r in self.running:
            out_len = len(r.output_ids)
            last = len(r.prompt_ids) + out_len - 1
            length = r.kv.length
            if length == last and r.pool is None:
                # may it continue? (not finished, its pending pick counted; inlined: this runs
                # for every request every step)
                if (r.finish_reason is None and not r.aborted and out_len < r.params.max_new_tokens
                        and last + 1 < ctx_len):
                    decoding.append(r)
                    if r.unresolved and r.params.needs_penalties:
                        host_picks = True
            elif length <= last:  # (equal: an embedding request's last prompt token)
                mid_prefill = True
        return decoding, mid_prefill, host_picks

    def _continue_prefills(self, plan: list[tuple[Request, int]], budget: int) -> int:
        """Next chunks of running prefills onto ``plan`` (its decodes so far); the budget left."""
        planned = len(plan)
        for r in self.running:
            if r.prefilling and budget > 0 and not r.aborted:
                want = min(r.seq_len - r.kv.length, budget, self.config.chunked_prefill_size)
                n = self.kv_manager.room_for(want, planned=planned)
                if n == 0:
                    break
                plan.append((r, n))
                budget -= n
                planned += n
        return budget

    def _admit_waiting(self, plan: list[tuple[Request, int]], decodes: int, budget: int, start: int) -> int:
        """Waiting requests in the policy's order onto ``plan`` (``decodes`` decodes, then
        prefill chunks) while the budgets allow (``start``: the step's prompt-token budget,
        ``budget`` of it left); the budget left."""
        limit = self.config.max_running_requests
        # (no room for another request: the policy's ranking, which can walk every waiting
        # prompt, would be thrown away)
        room = self.waiting and budget > 0 and len(self.running) < limit
        ready = [r for r in self.waiting if not self._blocked(r)] if room else []
        if not ready:
            return budget
        # requests computing prompt tokens this step (their final chunk included): later
        # requests sharing those tokens should wait a step and read them from the cache
        prefilling = [r for r, n in plan if n > 1 or r.kv.length + n < r.seq_len]
        planned = decodes + start - budget
        for r in self.policy.order(ready, PolicyContext(cache=self.cache, prefilling=prefilling)):
            if budget <= 0 or len(self.running) >= limit:
                break
            n = self.kv_manager.admit(r, budget, planned, self.running)
            if n is None:
                break
            self.waiting.remove(r)
            self.running.append(r)
            r.state = State.RUNNING
            plan.append((r, n))
            budget -= n
            planned += n
        return budget

    def _blocked(self, r: Request) -> bool:
        """A follower of an ``n > 1`` call waits until its leader's prompt is cached."""
        g = r.group
        return r.is_follower and g is not None and g.prompt_node is None and not g.leader_gone

    def fill_masks(self, rows: int, constrained: list[tuple[int, Request]]) -> np.ndarray:
        return self.constraints.fill_masks(rows, constrained)

    # ------------------------------------------------------------------ results

    def process(self, step: ScheduledStep, out: StepOutput) -> list[int]:
        if step.drafts:
            self.speculator.accept(step, out)  # only the picks that count are left
        off = 0
        for r, k in step.prompt_lp_reqs:
            r.prompt_logprobs.extend(out.prompt_logprobs[off : off + k])
            r.prompt_ranks.extend(out.prompt_ranks[off : off + k])
            if (top := r.params.prompt_top_logprobs) and out.prompt_top is not None:
                r.prompt_top.extend(row[:top] for row in out.prompt_top[off : off + k])
            off += k
        if step.pool_reqs:
            pooling.accumulate(step.pool_reqs, out.pooled)
        accepted = []
        eos, ctx_len = self.eos, self.context_len
        for i, (r, idx, tok) in enumerate(zip(step.sampled, step.pick_index, out.next_tokens, strict=True)):
            r.unresolved -= 1
            if r.finish_reason is not None:
                # finished while the step ran, or at an earlier accepted draft of this step:
                # its pick (the last of its placeholders that are left) is dropped
                del r.output_ids[idx:]
                continue
            r.output_ids[idx] = tok
            # the finish reason after the count-th generated token, if any
            p, count = r.params, idx + 1
            if count >= p.min_new_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
                r.finish("stop")
            elif count >= p.max_new_tokens or len(r.prompt_ids) + count >= ctx_len:
                r.finish("length")
            if r.matcher is not None:
                constraints.feed(r, tok)
            accepted.append(i)
        if out.aux is not None:  # (a drafter that reads the model's hidden states)
            self.speculator.features(step, out.aux)
        return accepted

    def rollback(self, step: ScheduledStep) -> None:
        self.kv_manager.rollback(step)
        # (from the end: a verify entry's placeholders follow one another)
        for r, idx in reversed(list(zip(step.sampled, step.pick_index, strict=True))):
            r.unresolved -= 1
            del r.output_ids[idx]

    def release_finished(self, inflight: frozenset[Request] = frozenset()) -> list[Request]:
        done = [r for r in self.running if r.finish_reason is not None and r not in inflight]
        if not done:
            return done
        for r in done:
            self._release(r)
            r.state = State.FINISHED
        gone = set(done)
        self.running[:] = [r for r in self.running if r not in gone]  # one pass, not a remove each
        return done

    # ------------------------------------------------------------------ leaving

    def _release(self, r: Request) -> None:
        """A running request's KV and its drafter's state, given back (it finished, was
        preempted or aborted)."""
        self.kv_manager.release(r)
        if self.speculator is not None:
            self.speculator.release([r])

    def _preempt(self, r: Request) -> None:
        self._release(r)
        self.running.remove(r)
        r.preemptions += 1
        self.stats.preemptions += 1
        self.add(r)

    def _drop_aborted(self, inflight: frozenset[Request] = frozenset()) -> None:
        for r in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(r)
            g = r.group
            if g is not None and r.is_follower:
                self.kv_manager.follower_gone(g)
            elif g is not None:
                g.leader_gone = True
            self._drop(r)
        for r in [r for r in self.running if r.aborted and r not in inflight]:
            if r.group is not None and not r.is_follower:
                r.group.leader_gone = True
            self._release(r)
            self.running.remove(r)
            self._drop(r)

    def _drop(self, r: Request) -> None:
        r.finish("abort")
        r.state = State.FINISHED
        self._dropped.append(r)

    # ------------------------------------------------------------------ accounting

    def accounting(self) -> dict[str, int]:
        return self.kv_manager.accounting(self.running)

    def check_accounting(self) -> None:
        self.kv_manager.check_accounting(self.running)
