"""The scheduler on its own: no model, a fake worker that checks each batch's KV layout.

The fake worker keeps a request-to-token table and what each KV slot holds (the token at its
position), applies a batch's table writes and new slots as the real worker does, and checks
that every request in the batch reads, for each of its positions, a slot holding that
position's token. Its picks are chosen by the test. Accounting is checked after every step.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from radixd.core.config import EngineConfig
from radixd.core.forward_batch import StepOutput
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Group, Request, State
from radixd.core.sampling_params import SamplingParams
from radixd.core.scheduler import (
    NEED_SYNC,
    PLACEHOLDER,
    ScheduledStep,
    Scheduler,
    SchedulerInterface,
)
from radixd.plugins.policies import FCFS, LongestPrefixMatch

EOS = 2


def pick(r: Request, idx: int) -> int:
    """The fake model's pick for ``r``'s ``idx``-th generated token (never EOS)."""
    return 1000 + idx


class FakeWorker:
    def __init__(self):
        self.table: dict[int, dict[int, int]] = {}  # row -> position -> slot
        self.holds: dict[int, int] = {}             # slot -> token whose KV it has
        self.batches = []
        self.fail_next = False

    def run(self, step: ScheduledStep, prev_picks: list[int] | None = None) -> StepOutput:
        b = step.batch
        ids = b.input_ids.tolist()
        for p, src in zip(b.placeholder_pos, b.placeholder_src, strict=True):
            ids[p] = prev_picks[src]  # (on the device: from the launched step's picks)
        for row, start, slots in b.table_writes:
            for k, s in enumerate(slots.tolist()):
                self.table.setdefault(row, {})[start + k] = s
        off = 0
        loc = b.out_cache_loc.tolist()
        assert len(set(loc)) == len(loc) == len(ids)
        for i, (row, pre, ext) in enumerate(zip(b.rows, b.prefix_lens, b.extend_lens, strict=True)):
            r = step.reqs[i]
            assert b.positions.tolist()[off : off + ext] == list(range(pre, pre + ext))
            for k in range(ext):
                self.table.setdefault(row, {})[pre + k] = loc[off + k]
                self.holds[loc[off + k]] = ids[off + k]
            seq = r.prompt_ids + r.output_ids
            for p in range(pre + ext):  # the KV this request attends to is its own sequence's
                if seq[p] != PLACEHOLDER:
                    assert self.holds[self.table[row][p]] == seq[p], (r.rid, p)
            off += ext
        self.batches.append(step)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("forward failed")
        picks = [pick(r, idx) for r, idx in zip(step.sampled, step.pick_index, strict=True)]
        return StepOutput(next_tokens=picks, prompt_logprobs=[0.0] * len(b.prompt_lp_pos),
                          prompt_ranks=[1] * len(b.prompt_lp_pos))


def make(policy=FCFS, slots: int = 1024, **cfg) -> Scheduler:
    cfg = {"max_running_requests": 8, "max_prefill_tokens": 64, "chunked_prefill_size": 64,
           "schedule_conservativeness": 0.0, **cfg}
    config = EngineConfig(**cfg)
    allocator = SlotAllocator(slots + 1)
    s = Scheduler(config, allocator=allocator, rows=RowAllocator(config.max_running_requests),
                  cache=RadixCache(allocator, enabled=config.radix_cache), policy=policy(config),
                  eos_token_ids=(EOS,), context_len=4096, vocab_size=2048)
    s.check_accounting()
    return s


def req(s: Scheduler, prompt: list[int], rid: str | None = None, **params) -> Request:
    params = {"max_new_tokens": 4, "temperature": 0.0, **params}
    r = Request(rid=rid or f"r{len(prompt)}-{prompt[0]}", prompt_ids=list(prompt), params=SamplingParams(**params),
                seed=0, arrival=s.next_arrival(), namespace=s.cache.default_namespace())
    s.add(r)
    return r


def prompt(n: int, base: int = 3) -> list[int]:
    return [base + (i % 90) for i in range(n)]


def step(s: Scheduler, w: FakeWorker) -> ScheduledStep | None:
    """One step without overlap: schedule, run, process, release; accounting checked."""
    st = s.schedule()
    s.check_accounting()
    if st is None:
        return None
    out = w.run(st)
    s.process(st, out)
    s.release_finished()
    s.check_accounting()
    return st


def drain(s: Scheduler, w: FakeWorker, limit: int = 200) -> list[ScheduledStep]:
    steps = []
    while s.has_work():
        st = step(s, w)
        assert st is not None, "work left but nothing scheduled"
        steps.append(st)
        assert len(steps) < limit
    return steps


def free_of_requests(s: Scheduler) -> None:
    a = s.accounting()
    assert a["private"] == 0 and a["locked"] == 0
    assert a["free"] + a["evictable"] == a["total"]


def test_admission_stops_at_the_token_budget():
    s, w = make(max_prefill_tokens=16, chunked_prefill_size=16), FakeWorker()
    a, b, c = (req(s, prompt(8, base), rid=x) for x, base in (("a", 3), ("b", 40), ("c", 70)))
    first = step(s, w)
    assert first.reqs == [a, b] and first.batch.extend_lens == [8, 8]
    assert s.waiting == [c] and c.state is State.WAITING
    second = step(s, w)
    assert second.reqs == [a, b, c] and second.batch.extend_lens == [1, 1, 8]
    drain(s, w)
    for r in (a, b, c):
        assert r.output_ids == [pick(r, i) for i in range(4)] and r.finish_reason == "length"
    assert s.stats.prefill_tokens == 24 and s.stats.decode_tokens == 3 * 4 - 3
    free_of_requests(s)


def test_steps_that_decode_take_the_mixed_prefill_budget():
    """While requests decode, a step carries at most ``mixed_prefill_tokens`` prompt tokens
    (arriving prompts come in such chunks); with nothing decoding, ``max_prefill_tokens``."""
    s, w = make(max_prefill_tokens=16, chunked_prefill_size=16, mixed_prefill_tokens=6), FakeWorker()
    a, b = req(s, prompt(12), rid="a", max_new_tokens=6), req(s, prompt(4, 40), rid="b", max_new_tokens=6)
    assert step(s, w).batch.extend_lens == [12, 4]  # nothing decodes yet: the whole budget
    c = req(s, prompt(14, 70), rid="c", max_new_tokens=2)
    lens = [st.batch.extend_lens for st in (step(s, w), step(s, w), step(s, w))]
    assert lens == [[1, 1, 6], [1, 1, 6], [1, 1, 2]]  # c's 14 tokens, 6 a step beside two decodes
    drain(s, w)
    assert c.output_ids == [pick(c, i) for i in range(2)]
    assert a.output_ids == [pick(a, i) for i in range(6)] and b.output_ids == [pick(b, i) for i in range(6)]
    free_of_requests(s)


def test_admission_stops_at_the_running_limit():
    s, w = make(max_running_requests=2), FakeWorker()
    rs = [req(s, prompt(6, 3 + 20 * i), rid=f"q{i}", max_new_tokens=2 + i) for i in range(3)]
    first = step(s, w)
    assert first.reqs == rs[:2] and s.waiting == [rs[2]]
    second = step(s, w)  # rs[0] finished after it: its row is free again only now
    assert second.reqs == rs[:2] and s.running == [rs[1]]
    third = step(s, w)
    assert third.reqs == [rs[1], rs[2]] and third.batch.extend_lens == [1, 6]
    drain(s, w)
    assert [len(r.output_ids) for r in rs] == [2, 3, 4]
    free_of_requests(s)


def test_admission_keeps_kv_for_the_prompts_being_computed():
    # 24 slots: the first 10-token prompt plus what the second would need (10 for itself and
    # 9 still reserved for the first, whose prompt is not computed yet) do not fit
    s, w = make(slots=24), FakeWorker()
    a, b = req(s, prompt(10), rid="a"), req(s, prompt(10, 50), rid="b")
    assert step(s, w).reqs == [a]
    assert step(s, w).reqs == [a, b]  # the first's prompt is computed: room for the second
    drain(s, w)
    # with more KV both start at once
    s, w = make(slots=29), FakeWorker()
    a, b = req(s, prompt(10), rid="a"), req(s, prompt(10, 50), rid="b")
    assert step(s, w).reqs == [a, b]
    drain(s, w)
    free_of_requests(s)


def test_chunked_prefill_then_decode():
    s, w = make(max_prefill_tokens=8, chunked_prefill_size=8), FakeWorker()
    r = req(s, prompt(20), max_new_tokens=3)
    steps = drain(s, w)
    assert [st.batch.extend_lens for st in steps] == [[8], [8], [4], [1], [1]]
    assert [st.batch.prefix_lens for st in steps] == [[0], [8], [16], [20], [21]]
    assert [st.sampled for st in steps] == [[], [], [r], [r], [r]]
    assert r.output_ids == [1000, 1001, 1002] and r.finish_reason == "length"
    assert s.stats.prefill_tokens == 20 and s.stats.decode_tokens == 2 and s.stats.steps == 5
    # the whole sequence but its last token is in the cache now
    assert s.cache.peek_prefix_len(r.prompt_ids + r.output_ids) == 22
    free_of_requests(s)


def test_a_chunk_shrinks_to_the_kv_left():
    # 35 slots: a (10 tokens) decodes while b's 24-token prompt comes in chunks of 16, then 8
    s, w = make(slots=35, max_prefill_tokens=16, chunked_prefill_size=16, radix_cache=False), FakeWorker()
    a = req(s, prompt(10), rid="a", max_new_tokens=20)
    b = req(s, prompt(24, 40), rid="b", max_new_tokens=2)
    assert step(s, w).reqs == [a]  # b's whole prompt does not fit beside a's yet
    st = step(s, w)
    assert st.reqs == [a, b] and st.batch.extend_lens == [1, 16]
    st = step(s, w)
    assert st.batch.extend_lens == [1, 7]  # 8 slots left: one for a's decode, 7 for b's chunk
    assert s.accounting()["free"] == 0
    st = step(s, w)  # no slot for a's decode: the later arrival gives way
    assert s.stats.preemptions == 1 and s.waiting == [b] and b.output_ids == []
    assert st.reqs == [a]
    drain(s, w)
    assert a.output_ids == [pick(a, i) for i in range(20)] and b.output_ids == [1000, 1001]
    free_of_requests(s)


def test_preemption_requeues_with_tokens_kept_and_resumes():
    # 17 slots; two 6-token prompts decode until the pool runs out
    s, w = make(slots=17), FakeWorker()
    a = req(s, prompt(6), rid="a", max_new_tokens=8)
    b = req(s, prompt(6, 50), rid="b", max_new_tokens=8)
    assert step(s, w).reqs == [a, b]
    seen_preempted = False
    steps = 0
    while s.has_work():
        before = s.stats.preemptions
        st = step(s, w)
        steps += 1
        if s.stats.preemptions > before:
            seen_preempted = True
            assert b in s.waiting and b.state is State.WAITING and b.preemptions == 1
            assert b.kv.row is None and b.kv.length == 0  # its KV went back
            assert b.output_ids == [pick(b, i) for i in range(len(b.output_ids))] and b.output_ids
            assert st.reqs == [a]
        assert steps < 100
    assert seen_preempted and s.stats.preemptions >= 1
    for r in (a, b):
        assert r.output_ids == [pick(r, i) for i in range(8)] and r.finish_reason == "length"
    free_of_requests(s)


def test_abort_mid_prefill_returns_the_kv():
    s, w = make(max_prefill_tokens=8, chunked_prefill_size=8, radix_cache=False), FakeWorker()
    r = req(s, prompt(30))
    step(s, w)
    assert r.kv.length == 8 and s.accounting()["locked"] + s.accounting()["private"] == 8
    s.abort(r)
    assert r.finish_reason is None  # it leaves at the next step boundary
    assert s.schedule() is None
    s.check_accounting()
    assert s.take_dropped() == [r] and s.take_dropped() == []
    assert r.finish_reason == "abort" and r.state is State.FINISHED and not s.has_work()
    a = s.accounting()
    assert a["free"] == a["total"]  # without the cache, nothing of it is kept
    s.abort(waiting := req(s, prompt(5)))
    assert s.schedule() is None and s.take_dropped() == [waiting]
    s.check_accounting()


def test_lpm_holds_back_a_shared_prefix_being_computed():
    shared = prompt(32)
    for policy, first_reqs in ((LongestPrefixMatch, 1), (FCFS, 2)):
        s, w = make(policy, lpm_dedup_min_tokens=8), FakeWorker()
        a = req(s, shared + [91, 92], rid="a")
        b = req(s, shared + [93, 94], rid="b")
        st = step(s, w)
        assert len(st.reqs) == first_reqs
        if policy is LongestPrefixMatch:
            assert st.reqs == [a] and s.waiting == [b]
            st = step(s, w)
            assert st.reqs == [a, b] and st.batch.extend_lens == [1, 2]  # b reads the prefix
            assert b.cached_tokens == 32
        else:
            assert b.cached_tokens == 0
        drain(s, w)
        free_of_requests(s)


def test_lpm_ranks_lazily_adding_only_the_requests_read(monkeypatch):
    """A step reads a few of the waiting requests: lpm puts only those (and the prompts still
    prefilling) into its de-duplication trie, in the order it would have chosen them all."""
    from radixd.core.policy import PolicyContext
    from radixd.plugins import policies

    s = make(LongestPrefixMatch, lpm_dedup_min_tokens=8)
    shared = prompt(32)
    waiting = [req(s, shared + [90 + i], rid=f"s{i}") if i % 2 else req(s, [200 + i] + prompt(39), rid=f"u{i}")
               for i in range(policies.LPM_MAX_QUEUE)]
    added = []
    add = policies._Trie.add

    def counted(trie, seq, ns):
        added.append(seq)
        add(trie, seq, ns)

    monkeypatch.setattr(policies._Trie, "add", counted)
    ctx = PolicyContext(cache=s.cache, prefilling=[])
    it = iter(s.policy.order(list(waiting), ctx))
    first = [next(it) for _ in range(2)]
    assert len(added) == 2
    rest = list(it)
    # the shared prefix is computed once: every later request repeating it is held back
    chosen = first + rest
    assert [r.rid for r in chosen][:2] == ["u0", "s1"] and not any(r.rid.startswith("s") for r in chosen[2:])
    assert len(chosen) == 1 + policies.LPM_MAX_QUEUE // 2


def test_followers_wait_for_the_leaders_prompt():
    s, w = make(), FakeWorker()
    g = Group(size=2, namespace=0, followers_waiting=1)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, n=2)
    reqs = [Request(rid=f"g-{i}", prompt_ids=prompt(12), params=params, seed=i, arrival=s.next_arrival(),
                    index=i, group=g) for i in range(2)]
    for r in reqs:
        s.add(r)
    assert step(s, w).reqs == [reqs[0]]
    assert g.prompt_node is not None and g.followers_waiting == 1
    st = step(s, w)
    assert st.reqs == reqs and st.batch.extend_lens == [1, 1]  # the follower's prompt is cached
    assert reqs[1].cached_tokens == 11 and g.followers_waiting == 0
    drain(s, w)
    free_of_requests(s)


def run_overlapped(s: Scheduler, w: FakeWorker, limit: int = 200) -> list:
    """The engine's overlap loop: schedule step N+1 before step N's picks are read."""
    events = []
    launched, picks = None, None
    while s.has_work() or launched is not None:
        st = s.schedule(launched)
        s.check_accounting()
        if st is NEED_SYNC or st is None:
            assert launched is not None or st is None
            events.append("sync" if st is NEED_SYNC else "wait")
            if launched is None:
                break
            s.process(launched, picks)
            s.release_finished()
            s.check_accounting()
            launched = None
            continue
        out = w.run(st, picks.next_tokens if launched is not None else None)
        events.append(st)
        if launched is not None:
            s.process(launched, picks)
            s.release_finished(frozenset(st.reqs))
            s.check_accounting()
        launched, picks = st, out
        assert len(events) < limit
    return events


def test_overlap_builds_on_placeholders():
    s, w = make(), FakeWorker()
    a, b = req(s, prompt(5), rid="a"), req(s, prompt(7, 50), rid="b")
    first = s.schedule()
    out = w.run(first)
    assert [r.output_ids for r in (a, b)] == [[PLACEHOLDER], [PLACEHOLDER]] and a.unresolved == 1
    second = s.schedule(first)
    assert second.placeholder_reqs == [a, b]
    assert second.batch.placeholder_pos == [0, 1] and second.batch.placeholder_src == [0, 1]
    assert second.batch.input_ids.tolist() == [0, 0]  # filled in on the device
    assert second.pick_index == [1, 1]
    out2 = w.run(second, out.next_tokens)  # (checks that the KV it reads is the picks')
    assert s.process(first, out) == [0, 1]
    s.release_finished(frozenset(second.reqs))
    s.check_accounting()
    assert a.output_ids == [1000, PLACEHOLDER] and a.unresolved == 1
    s.process(second, out2)
    assert a.output_ids == [1000, 1001] and a.unresolved == 0
    events = run_overlapped(s, w)
    assert all(e != "sync" for e in events)
    for r in (a, b):
        assert r.output_ids == [pick(r, i) for i in range(4)]
    free_of_requests(s)


def test_overlap_needs_sync_for_penalties_and_preemption():
    s, w = make(), FakeWorker()
    a = req(s, prompt(5), repetition_penalty=1.2)
    first = s.schedule()
    out = w.run(first)
    assert s.schedule(first) is NEED_SYNC  # the penalty needs the pending token
    s.process(first, out)
    s.check_accounting()
    second = s.schedule()
    assert second.batch.sampling.rep_tokens is not None and 1000 in second.batch.sampling.penalty_tokens.tolist()
    s.process(second, w.run(second))
    drain(s, w)
    assert a.output_ids == [pick(a, i) for i in range(4)]

    s, w = make(slots=13), FakeWorker()  # two 6-token prompts: the second decode step has no room
    a, b = req(s, prompt(6), rid="a", max_new_tokens=8), req(s, prompt(6, 50), rid="b", max_new_tokens=8)
    events = run_overlapped(s, w)
    assert "sync" in events and s.stats.preemptions >= 1  # preempting waits for the launched step
    for r in (a, b):
        assert r.output_ids == [pick(r, i) for i in range(8)]
    free_of_requests(s)


@pytest.mark.parametrize("cache", [True, False])
def test_rollback_forgets_a_failed_step(cache):
    s, w = make(max_prefill_tokens=8, chunked_prefill_size=8, radix_cache=cache), FakeWorker()
    r = req(s, prompt(12))
    step(s, w)
    before = (r.kv.length, r.kv.cached_len, list(r.output_ids), s.accounting())
    st = s.schedule()  # the last chunk: it samples
    assert st.batch.extend_lens == [4] and r.output_ids == [PLACEHOLDER]
    w.fail_next = True
    with pytest.raises(RuntimeError):
        w.run(st)
    s.rollback(st)
    s.check_accounting()
    assert (r.kv.length, r.kv.cached_len, list(r.output_ids), s.accounting()) == before
    assert r.unresolved == 0
    if cache:
        assert s.cache.peek_prefix_len(r.prompt_ids) == 8  # the chunk's nodes are gone
    again = step(s, w)  # the same step again, and the request carries on
    assert again.batch.extend_lens == [4] and again.batch.prefix_lens == [8]
    dec = s.schedule()
    w.fail_next = True
    with pytest.raises(RuntimeError):
        w.run(dec)
    s.rollback(dec)
    s.check_accounting()
    assert r.output_ids == [1000] and r.kv.length == 12
    drain(s, w)
    assert r.output_ids == [pick(r, i) for i in range(4)]
    free_of_requests(s)


def test_stop_token_and_grammar_finish():
    class Matcher:
        def __init__(self):
            self.accepted = []

        def fill_mask(self, out):
            out[:] = False
            out[1000:1002] = True

        def accept_token(self, tok):
            self.accepted.append(tok)
            return True

        def is_terminated(self):
            return len(self.accepted) == 2

    s, w = make(), FakeWorker()
    stop = req(s, prompt(4), rid="stop", stop_token_ids=[1001], max_new_tokens=9)
    g = req(s, prompt(4, 60), rid="grammar", max_new_tokens=9)
    g.matcher = Matcher()
    first = step(s, w)
    allowed = first.batch.sampling.allowed
    assert allowed.shape == (2, 2048) and allowed[0].all() and allowed[1].sum() == 2
    drain(s, w)
    assert stop.output_ids == [1000, 1001] and stop.finish_reason == "stop"
    assert g.matcher.accepted == [1000, 1001] and g.finish_reason == "stop"
    free_of_requests(s)


def test_min_new_tokens_bans_the_stop_tokens():
    s, w = make(), FakeWorker()
    req(s, prompt(4), min_new_tokens=2, stop_token_ids=[7])
    st = s.schedule()
    sb = st.batch.sampling
    assert sb.banned_rows.tolist() == [0, 0] and sb.banned_tokens.tolist() == [EOS, 7]
    s.process(st, w.run(st))
    s.check_accounting()
    torch.testing.assert_close(s.schedule().batch.sampling.banned_tokens, torch.tensor([EOS, 7]))


def test_the_scheduler_keeps_its_interface():
    methods = [n for n, v in vars(SchedulerInterface).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert sorted(methods) == sorted(["next_arrival", "add", "abort", "has_work", "schedule", "process", "rollback",
                                      "release_finished", "take_dropped", "fill_masks", "accounting",
                                      "check_accounting"])
    for name in methods:
        contract = getattr(SchedulerInterface, name)
        assert contract.__doc__, name
        mine = getattr(Scheduler, name)
        assert mine is not contract, name  # implemented, not inherited
        assert list(inspect.signature(mine).parameters) == list(inspect.signature(contract).parameters), name
    s = make()
    assert SchedulerInterface in Scheduler.__mro__ and s.waiting == [] and s.running == [] and s.stats.steps == 0
