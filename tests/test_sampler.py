"""Unit tests of ``radixd.core.sampler.sample`` on hand-made logits (no model).

Each test builds a ``SamplingBatch`` by hand, so the sampler is checked against the
definitions: greedy = argmax, draws follow softmax(logits / T) restricted by top-k / top-p /
min-p, penalties as HF (repetition) and OpenAI (frequency, presence) define them, banned
tokens never win, logprobs are log_softmax of the raw logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from radixd.core.forward_batch import SamplingBatch
from radixd.core.sampler import apply_penalties, sample, uniform_noise

# chi-square critical value for 3 degrees of freedom at p = 1e-4 (and 1 dof at p = 1e-4).
CHI2_3DOF = 21.1
CHI2_1DOF = 15.1


def make_sb(
    rows: int,
    *,
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    min_p: float | list[float] = 0.0,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    **extra,
) -> SamplingBatch:
    def col(v, dtype):
        v = v if isinstance(v, list) else [v] * rows
        assert len(v) == rows
        return torch.tensor(v, dtype=dtype)

    temp = col(temperature, torch.float32)
    return SamplingBatch(
        temperature=temp,
        top_p=col(top_p, torch.float32),
        top_k=col(top_k, torch.int64),
        min_p=col(min_p, torch.float32),
        seeds=torch.tensor(seeds if seeds is not None else list(range(rows)), dtype=torch.int64),
        steps=torch.tensor(steps if steps is not None else [0] * rows, dtype=torch.int64),
        all_greedy=extra.pop("all_greedy", bool((temp == 0).all())),
        **extra,
    )


def draw(logits_row: torch.Tensor, n: int, *, vary: str = "seed", seed0: int = 0, **kw) -> list[int]:
    """``n`` draws from one row of logits: one batch row per seed (or per step of one seed)."""
    logits = logits_row[None, :].repeat(n, 1).float()
    if vary == "seed":
        sb = make_sb(n, seeds=[seed0 + i for i in range(n)], **kw)
    else:
        sb = make_sb(n, seeds=[seed0] * n, steps=list(range(n)), **kw)
    return sample(logits, sb).next_tokens


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def histogram(tokens: list[int], vocab: int) -> list[int]:
    h = [0] * vocab
    for t in tokens:
        h[t] += 1
    return h


def reference_allowed(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens top-k, then top-p (smallest prefix with mass >= top_p), then min-p allow (float64)."""
    z = row.double() / temperature
    order = torch.argsort(z, descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    p = torch.softmax(z[order], dim=0).tolist()
    keep, mass = [], 0.0
    for tok, pi in zip(order, p, strict=True):
        if top_p < 1.0 and mass >= top_p:
            break
        keep.append((tok, pi))
        mass += pi
    top = keep[0][1]
    return {tok for tok, pi in keep if pi >= min_p * top}


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_all_greedy_and_mixed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 64, generator=g) * 3
    want = logits.argmax(-1).tolist()
    assert sample(logits.clone(), make_sb(16, temperature=0.0)).next_tokens == want
    # Greedy rows inside a batch that also samples: still the argmax.
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(16)]
    got = sample(logits.clone(), make_sb(16, temperature=temps)).next_tokens
    assert [t for i, t in enumerate(got) if i % 2 == 0] == want[0::2]


def test_top_k_1_equals_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=g) * 2
    toks = draw(logits[0], 500, temperature=1.5, top_k=1)
    assert set(toks) == {int(logits.argmax())}


@pytest.mark.parametrize("temperature", [1e-30, 1e-38])
def test_tiny_temperature_is_argmax(temperature):
    """logits / T overflowing to +inf for several tokens must not turn argmax into a tie."""
    logits = torch.tensor([5.0, 10.0, 7.0, -3.0])
    assert set(draw(logits, 64, temperature=temperature)) == {1}


# ----------------------------------------------------------------------------- distribution


P4 = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_temperature_draws_follow_distribution(temperature, vary):
    logits = torch.log(torch.tensor(P4))
    want = [p ** (1 / temperature) for p in P4]
    want = [w / sum(want) for w in want]
    toks = draw(logits, 20000, vary=vary, temperature=temperature, seed0=12345)
    counts = histogram(toks, 4)
    assert chi2(counts, want) < CHI2_3DOF, (counts, want)


def test_distribution_is_independent_of_logit_shift_and_token_order():
    """The same distribution at other token ids (another permutation) is still followed."""
    perm = [2, 0, 3, 1]
    logits = torch.empty(4)
    for p, tok in zip(P4, perm, strict=True):
        logits[tok] = math.log(p) + 7.0
    toks = draw(logits, 20000, seed0=999)
    counts = histogram(toks, 4)
    want = [0.0] * 4
    for p, tok in zip(P4, perm, strict=True):
        want[tok] = p
    assert chi2(counts, want) < CHI2_3DOF, counts


def test_top_k_renormalizes():
    logits = torch.log(torch.tensor(P4))
    toks = draw(logits, 20000, top_k=2, seed0=7)
    counts = histogram(toks, 4)
    assert counts[0] == counts[1] == 0
    assert chi2(counts[2:], [3 / 7, 4 / 7]) < CHI2_1DOF, counts


# ----------------------------------------------------------------------------- filters

FILTERS = [
    dict(top_k=3),
    dict(top_k=10),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=0.7),
    dict(min_p=0.3),
    dict(min_p=0.05, temperature=1.5),
    dict(top_k=8, top_p=0.8, min_p=0.1),
]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_filters_never_emit_outside_allowed_set(kw):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 32, generator=g) * 2
    for r, row in enumerate(rows):
        allowed = reference_allowed(
            row, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0)
        )
        assert 1 <= len(allowed) < 32
        toks = draw(row, 3000, seed0=r * 100_000, **kw)
        assert set(toks) <= allowed, f"row {r}: drew {sorted(set(toks) - allowed)} outside {sorted(allowed)}"
        # The filter keeps the allowed tokens drawable (not just the argmax).
        assert len(set(toks)) >= min(len(allowed), 2)


def test_filtered_tokens_never_win_on_an_extreme_noise_draw():
    """Seed 11116 at step 0 once drew noise that rounded to exactly 1.0 for token 5
    (``-log(1.0) == -0.0``; a dropped token's ``0 / -0.0`` is NaN and argmax picks NaN)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.0, -1.0]])
    for kw in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.5)):
        allowed = reference_allowed(logits[0], 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
        for seed in (11116, 5685566, 7635163):  # all three hit noise == 1.0 under the old hash
            got = sample(logits.clone(), make_sb(1, seeds=[seed], **kw)).next_tokens[0]
            assert got in allowed, (kw, seed, got)
    banned = dict(banned_rows=torch.tensor([0]), banned_tokens=torch.tensor([5]))
    assert sample(logits.clone(), make_sb(1, seeds=[11116], **banned)).next_tokens[0] != 5


def test_uniform_noise_is_in_the_open_unit_interval():
    seeds = torch.arange(0, 1 << 14, dtype=torch.int64)
    toks = torch.arange(64, dtype=torch.int64).expand(seeds.numel(), 64)
    u = uniform_noise(seeds, torch.zeros_like(seeds), toks)
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert bool((-torch.log(u) > 0).all())
    # Roughly uniform.
    assert abs(float(u.mean()) - 0.5) < 0.005
    u1 = uniform_noise(torch.tensor([11116]), torch.tensor([0]), torch.arange(8)[None, :])
    assert float(u1.max()) < 1.0


def test_top_p_boundary_is_the_smallest_prefix_reaching_top_p():
    probs = torch.tensor([0.5, 0.25, 0.25])
    logits = torch.log(probs)
    assert torch.softmax(logits, -1).tolist() == [0.5, 0.25, 0.25]  # exact in float32
    assert set(draw(logits, 2000, top_p=0.5)) == {0}
    assert set(draw(logits, 2000, top_p=0.75)) == {0, 1}
    assert set(draw(logits, 2000, top_p=0.76)) == {0, 1, 2}
    assert set(draw(logits, 2000, top_p=1.0)) == {0, 1, 2}


# ----------------------------------------------------------------------------- penalties


def penalty_sb(rows: int, *, rep=1.0, freq=0.0, pres=0.0, rep_seen=None, generated=None) -> SamplingBatch:
    def per_row(v):
        return torch.tensor(v if isinstance(v, list) else [v] * rows, dtype=torch.float32)

    sb = make_sb(rows, temperature=0.0)
    sb.repetition_penalty, sb.frequency_penalty, sb.presence_penalty = per_row(rep), per_row(freq), per_row(pres)
    if rep_seen is not None:
        sb.rep_rows = torch.tensor([r for r, toks in enumerate(rep_seen) for _ in toks], dtype=torch.int64)
        sb.rep_tokens = torch.tensor([t for toks in rep_seen for t in toks], dtype=torch.int64)
    if generated is not None:
        sb.penalty_rows = torch.tensor([r for r, toks in enumerate(generated) for _ in toks], dtype=torch.int64)
        sb.penalty_tokens = torch.tensor([t for toks in generated for t in toks], dtype=torch.int64)
    return sb


LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 0.0], [1.0, 1.0, -2.0, 3.0, -0.5, 2.5]])


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = LOGITS.clone()
    apply_penalties(logits, penalty_sb(2, rep=[2.0, 1.5], rep_seen=[[0, 1, 5], [2, 3]]))
    want = LOGITS.clone()
    want[0, 0], want[0, 1], want[0, 5] = 2.0 / 2, -1.0 * 2, 0.0
    want[1, 2], want[1, 3] = -2.0 * 1.5, 3.0 / 1.5
    torch.testing.assert_close(logits, want)


def test_frequency_and_presence_penalties():
    logits = LOGITS.clone()
    generated = [[4, 4, 4, 1], [0, 3, 3]]
    apply_penalties(logits, penalty_sb(2, freq=[0.5, -0.25], pres=[1.0, 0.75], generated=generated))
    want = LOGITS.clone()
    for r, toks in enumerate(generated):
        freq, pres = [0.5, -0.25][r], [1.0, 0.75][r]
        for t in set(toks):
            want[r, t] -= freq * toks.count(t) + pres
    torch.testing.assert_close(logits, want)


def test_penalties_change_the_sampled_token():
    # Row 0: the argmax (4) is repeated and divided by 2 -> token 0 (2.0) wins over 4.0/2.5.
    # Row 1: token 3 generated 3 times with frequency 0.5 -> 3 - 1.5 = 1.5 < 2.5: token 5 wins.
    sb = penalty_sb(2, rep=[2.5, 1.0], freq=[0.0, 0.5], rep_seen=[[4], []], generated=[[], [3, 3, 3]])
    assert sample(LOGITS.clone(), sb).next_tokens == [0, 5]
    # Presence alone: a token seen once drops by exactly the presence penalty.
    sb = penalty_sb(2, pres=[2.5, 0.0], generated=[[4], [3]])
    assert sample(LOGITS.clone(), sb).next_tokens == [0, 3]


def test_banned_tokens_never_chosen():
    logits = torch.log(torch.tensor(P4))[None, :].repeat(4000, 1)
    rows = torch.arange(4000).repeat_interleave(2)
    toks = torch.tensor([3, 1]).repeat(4000)
    sb = make_sb(4000, seeds=list(range(4000)), banned_rows=rows, banned_tokens=toks)
    got = sample(logits.clone(), sb).next_tokens
    assert set(got) == {0, 2}
    # Greedy, banned argmax.
    sb = make_sb(1, temperature=0.0, banned_rows=torch.tensor([0]), banned_tokens=torch.tensor([4]))
    assert sample(LOGITS[:1].clone(), sb).next_tokens == [0]


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_chosen_token():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g) * 2
    raw = torch.log_softmax(logits, -1)
    sb = make_sb(6, temperature=[0.0, 0.7, 1.0, 1.3, 0.0, 1.0], top_k=[0, 5, 0, 0, 0, 3], top_logprobs=4, want_logprobs=True)
    sb.repetition_penalty = torch.full((6,), 1.3)
    sb.frequency_penalty = torch.full((6,), 0.4)
    sb.presence_penalty = torch.full((6,), 0.2)
    sb.rep_rows = torch.tensor([0, 1, 2])
    sb.rep_tokens = torch.tensor([int(logits[0].argmax()), 7, 8])
    sb.penalty_rows = torch.tensor([3, 3])
    sb.penalty_tokens = torch.tensor([9, 9])
    out = sample(logits.clone(), sb)
    assert out.logprobs is not None and out.top_logprobs is not None
    for r, tok in enumerate(out.next_tokens):
        assert out.logprobs[r] == pytest.approx(float(raw[r, tok]), abs=1e-5)
        top = out.top_logprobs[r]
        assert len(top) == 4
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        want_vals, want_ids = raw[r].topk(4)
        assert [t for t, _ in top] == want_ids.tolist()
        assert vals == pytest.approx(want_vals.tolist(), abs=1e-5)
        assert all(isinstance(t, int) for t, _ in top)


def test_no_logprobs_unless_asked():
    out = sample(LOGITS.clone(), make_sb(2))
    assert out.logprobs is None and out.top_logprobs is None


# ----------------------------------------------------------------------------- seeds


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 100, generator=g)
    kw = dict(temperature=[1.0, 0.8, 1.2, 0.0, 1.0, 1.0, 0.5, 2.0], top_k=[0, 0, 20, 0, 5, 0, 0, 0],
              top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.7, 1.0, 1.0], seeds=[11, 22, 33, 44, 55, 66, 77, 88],
              steps=[0, 3, 5, 7, 1, 2, 9, 4])
    batch = sample(logits.clone(), make_sb(8, **kw)).next_tokens
    for r in range(8):
        one = {k: [v[r]] for k, v in kw.items()}
        assert sample(logits[r : r + 1].clone(), make_sb(1, **one)).next_tokens == [batch[r]]


def test_seed_and_step_change_the_draw():
    logits = torch.zeros(64)  # uniform over 64 tokens
    by_seed = draw(logits, 200, seed0=1)
    assert len(set(by_seed)) > 40
    by_step = draw(logits, 200, vary="step", seed0=1)
    assert len(set(by_step)) > 40
    assert draw(logits, 200, seed0=1) == by_seed  # deterministic
