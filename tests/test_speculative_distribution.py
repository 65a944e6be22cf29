"""Sampled continuations under speculative decoding follow the target distribution: a
chi-square over 3-token continuations against the exact probabilities, with a drafter whose
drafts are accepted about as often as rejected."""

from __future__ import annotations

import asyncio
import random

import torch
from conftest import _hf_model

from radixd import Engine, SamplingParams
from radixd.plugins import hookimpl, make_plugin_manager


class TopChoice:
    """Drafts one of the target's ``K`` likeliest next tokens at random (from transformers'
    logits): accepted about as often as rejected, so a verifier that accepted too often or
    too rarely would shift the continuations' distribution."""

    name = "topchoice"
    model = None
    rng = random.Random(0)
    tops: dict[tuple, list[int]] = {}

    def __init__(self, config, cache):
        pass

    @classmethod
    def top(cls, seq: list[int]) -> list[int]:
        key = tuple(seq)
        if key not in cls.tops:
            with torch.no_grad():
                cls.tops[key] = cls.model(torch.tensor([seq])).logits[0, -1].topk(K).indices.tolist()
        return cls.tops[key]

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks, strict=True):
            seq, d = list(r.seq), []
            for _ in range(k):
                d.append(self.rng.choice(self.top(seq)))
                seq.append(d[-1])
            out.append(d)
        return out


K = 3           # top_k of the sampled requests: K**3 continuations of 3 tokens
TEMP = 0.7
SAMPLES = 1800


def exact_distribution(model, prompt: list[int]) -> dict[tuple, float]:
    """P(t1 t2 t3) under temperature TEMP and top_k K, from transformers' logits."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for cont, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(cont)])).logits[0, -1].double()
            top = logits.topk(K)
            q = torch.softmax(top.values / TEMP, -1)
            for t, qt in zip(top.indices.tolist(), q.tolist(), strict=True):
                nxt[cont + (t,)] = p * qt
        probs = nxt
    return probs


def chi_square(counts: dict[tuple, int], probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic with cells of small expectation pooled; (statistic, dof)."""
    big = [c for c, p in probs.items() if p * n >= 5]
    pooled_p = 1.0 - sum(probs[c] for c in big)
    stat = sum((counts.get(c, 0) - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    cells = len(big)
    if pooled_p * n >= 5:
        rest = n - sum(counts.get(c, 0) for c in big)
        stat += (rest - pooled_p * n) ** 2 / (pooled_p * n)
        cells += 1
    return stat, cells - 1


async def test_sampled_continuations_follow_the_target_distribution(tiny_models):
    """1800 sampled 3-token continuations of one prompt (the 2nd and 3rd tokens verified from
    drafts) against the exact distribution: a chi-square at p = 0.001. The same test would
    refuse a verifier that took every plausible draft: its distribution is checked to be far
    from the target's at this sample size."""
    from scipy.stats import chi2

    path = tiny_models["llama"]
    model = _hf_model(path)
    TopChoice.model = model
    prompt = [3, 17, 42, 9, 77, 5]
    probs = exact_distribution(model, prompt)

    class Plugin:
        @hookimpl
        def radixd_drafters(self):
            return {"topchoice": TopChoice}

    pm = make_plugin_manager(load_entry_points=False, extra=[Plugin()])
    eng = Engine(model=str(path), kv_cache_tokens=8192, plugin_manager=pm, speculative_algorithm="topchoice",
                 speculative_num_draft_tokens=2, speculative_adaptive=False, speculative_max_batch=0,
                 max_running_requests=256, seed=1)
    counts: dict[tuple, int] = {}
    try:
        params = SamplingParams(max_new_tokens=3, temperature=TEMP, top_k=K, ignore_eos=True, n=16)
        calls = [eng.generate(input_ids=prompt, params=params) for _ in range(SAMPLES // 16 + 1)]

        async def one(gen):
            got: dict[int, list[int]] = {}
            async for o in gen:
                got.setdefault(o.index, []).extend(o.token_ids)
            return list(got.values())

        outs = [s for c in await asyncio.gather(*(one(g) for g in calls)) for s in c][:SAMPLES]
        st = eng.stats()
    finally:
        await eng.stop()
    for s in outs:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    assert st["spec_verifies"] >= SAMPLES and 0.2 < st["spec_accepted_tokens"] / st["spec_draft_tokens"] < 0.9
    stat, dof = chi_square(counts, probs, SAMPLES)
    limit = chi2.ppf(0.999, dof)
    assert stat < limit, (stat, limit)
    # power: a verifier accepting every top-K draft makes tokens 2 and 3 uniform over the top K
    wrong = {c: sum(v for k, v in probs.items() if k[0] == c[0]) / K**2 for c in probs}
    expected_stat = sum((wrong[c] - p) ** 2 / p for c, p in probs.items()) * SAMPLES
    assert expected_stat > 3 * limit
