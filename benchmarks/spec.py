"""Speculative decoding against plain decoding, same prompts, same engine settings.

CPU (``--device cpu``, the default model SmolLM2-135M-Instruct, greedy, batch 1):

- ``ngram``: the built-in prompt-lookup drafter on copy-heavy prompts (repeating, correcting
  and quoting a passage, editing code) and on chat: tok/s plain and speculative, the ratio,
  drafted tokens accepted, tokens per verify, and whether the outputs are the same; with
  ``--eagle-topk W`` > 1 also the same drafter drafting token trees (``speculative.eagle_topk``),
  its runs alternating with the other two (``tree_*``, ``tree_vs_chain``).

GPU (``--device cuda``, random bf16 weights in Llama-3-8B's shape, no downloads):

- ``verify``: the cost of a verify step of k = 1..8 drafts relative to a decode step (median
  step times at batch 1 with drafts that are always wrong: every step verifies k and yields
  one token);
- ``accept``: batch-1 tok/s with 4 drafted tokens at acceptance p = 0.5 .. 0.9 and 1.0 (a
  draft identical to the target: the mechanism's upper bound), against plain. The drafter
  proposes the target's own greedy token (from a plain run of the same prompt) with
  probability p at each position, else a wrong one; the acceptance it met is measured;
- ``ngram``: n-gram drafting on repetitive prompts (random weights: what the drafter finds in
  the model's own output), batch 1;
- ``batch``: 64 requests at once, plain against p = 0.7 (speculation steps aside past
  ``speculative_max_batch``) and against p = 0.7 forced to draft (``max_batch`` 0);
- ``standalone``: batch 1 with a draft model identical to the target (the same checkpoint):
  acceptance near 1 at the price of a second model's weight reads per draft;
- ``tree``: token trees (``speculative.eagle_topk``): the verify step's cost for trees of
  ``w`` random, always-wrong branches of depth 4 sharing only the root (w = 2, 3, 4: 8, 12,
  16 nodes), relative to a decode step, as ``verify`` does for chains;
- ``eagle3``: an EAGLE-3 head of random weights at the target's shape, written here in
  SGLang's layout (``--eagle3-topk``: its token trees' width): the step period drafting 4
  tokens (the head's chain steps, its extend over each step's rows, the verify; its random
  drafts all miss) against plain, batch-1 tok/s with the verifier forced to take its drafts
  at p = 0.5 / 0.7 / 0.9, and 64 requests at once, where speculation steps aside but the head
  still follows every request each step, against plain.

    python -m benchmarks.spec --device cpu --out benchmarks/results/spec
    python -m benchmarks.spec --device cpu --eagle-topk 3 --out DIR   (and n-gram trees)
    python -m benchmarks.spec --device cuda --out DIR          (one H200)
    python -m benchmarks.spec --device cuda --sections eagle3 --out DIR   (the EAGLE-3 head alone)
    python -m benchmarks.spec --quick --out DIR                (every section, tiny, CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import gpu_bench
from benchmarks.common import (
    CPU_ENGINE,
    SHAPES,
    Log,
    builtin_plugins,
    checkpoint_dir,
    environment,
    free,
    timed_section,
    write_json,
)
from radixd import Engine, SamplingParams
from radixd.core.speculative.tree import from_continuations
from radixd.plugins import hookimpl

PASSAGE = ("The lighthouse stood at the end of the harbour wall for two hundred years. Every night the keeper "
           "climbed one hundred and twelve steps, trimmed the wick and wound the clockwork that turned the lens. "
           "Ships counted its flashes to know which coast they were passing: three short and one long meant "
           "the northern cape, two long meant the harbour itself.")
TYPOS = PASSAGE.replace("harbour", "harbuor").replace("hundred", "hundered").replace("flashes", "flashs")
CODE = ("def total(xs):\n    t = 0\n    for x in xs:\n        if x > 0:\n            t = t + x\n    return t\n\n"
        "def mean(xs):\n    t = total(xs)\n    return t / len(xs)\n")
COPY_PROMPTS = [
    f"Repeat the following passage word for word.\n\n{PASSAGE}",
    f"Correct the spelling mistakes in this text and write out the whole corrected text.\n\n{TYPOS}",
    f"Summarise the passage below, quoting its most important sentences exactly.\n\n{PASSAGE}",
    f"Rename the variable `t` to `acc` in this code and print the full code.\n\n```python\n{CODE}```",
]
CHAT_PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about autumn leaves.",
]
K_DEFAULT = 4
RATES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class AtRate:
    """Drafts ``k`` random tokens; with ``forced_acceptance`` on its engine's speculator the
    verifier takes each of them with probability ``p``, in order, up to the first it refuses.

    (A drafter that proposes the target's own greedy continuation cannot be held at a rate on
    random bf16 weights: a verify step's rows run through the few-row kernels where plain
    batch-1 decoding takes the one-row ones, the two roundings part within a few dozen tokens
    -- ``verify_rows_vs_plain`` in the results -- and from there the guesses miss. Taking
    drafts by a coin does the same device work as accepting them: the verify step, the KV
    kept and freed, the tokens emitted; what the tokens are does not change the cost.)"""

    name = "at-rate"
    vocab = 1000
    rng = random.Random(0)

    def __init__(self, config, cache):
        pass

    def propose(self, reqs, ks):
        cls = type(self)
        return [[cls.rng.randrange(cls.vocab) for _ in range(k)] for k in ks]


class forced_acceptance:  # noqa: N801 (a context manager, named for the with-statement)
    """While active, ``eng``'s verify entries take each draft with probability ``p`` (rewriting
    the step's picks at those rows to the drafts before ``Speculator.accept`` compares them)."""

    def __init__(self, eng: Engine, p: float, seed: int = 0):
        self.spec, self.p, self.rng = eng.scheduler.speculator, p, random.Random(seed)

    def __enter__(self):
        orig = self.spec.accept

        def accept(step, out):
            toks, i = list(out.next_tokens), 0
            while i < len(step.sampled):
                d = step.drafts.get(step.sampled[i])
                if d is None:
                    i += 1
                    continue
                for j, t in enumerate(d):
                    if self.rng.random() >= self.p:
                        break
                    toks[i + j] = t
                i += len(d) + 1
            out.next_tokens = toks
            orig(step, out)

        self.spec.accept = accept
        return self

    def __exit__(self, *exc):
        del self.spec.accept  # (the instance attribute goes; the class's method is back)


class AtRateTree(AtRate):
    """Drafts ``width`` random branches of ``k`` tokens each, sharing only the root: a token
    tree of ``width * k`` nodes (the speculator verifies what ``k`` leaves of it)."""

    name = "at-rate-tree"
    width = 2

    def propose(self, reqs, ks):
        cls = type(self)
        return [from_continuations([[cls.rng.randrange(cls.vocab) for _ in range(k)] for _ in range(cls.width)])
                for k in ks]


class AtRatePlugin:
    @hookimpl
    def radixd_drafters(self):
        return {"at-rate": AtRate, "at-rate-tree": AtRateTree}


async def generate(eng: Engine, prompts: list[list[int]], new: int, *, concurrent: bool = False) -> tuple[list, float]:
    """Each prompt's greedy tokens and the wall seconds (one after another, or all at once)."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)

    async def one(p):
        toks = []
        async for o in eng.generate(input_ids=p, params=params):
            toks += o.token_ids
        return toks

    t = time.perf_counter()
    if concurrent:
        outs = await asyncio.gather(*(one(p) for p in prompts))
    else:
        outs = [await one(p) for p in prompts]
    return outs, time.perf_counter() - t


def spec_counts(eng: Engine) -> dict:
    st = eng.stats()
    v, d, a = (st.get(k, 0) for k in ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens"))
    return {"verifies": v, "drafted": d, "accepted": a, "accepted_of_drafted": round(a / d, 3) if d else 0.0,
            "tokens_per_verify": round((a + v) / v, 3) if v else 0.0}


class Steps:
    """The period of decode steps (ms): the median time between one step's end and the next's,
    both decode only (with overlap scheduling a step's own launch-to-end time spans two periods)."""

    def __init__(self, eng: Engine):
        self.ms: list[float] = []
        self._last: float | None = None
        eng.stats_hook = self._step

    def _step(self, s) -> None:
        now = time.perf_counter()
        if s.prefill_tokens == 0 and self._last is not None:
            self.ms.append((now - self._last) * 1e3)
        self._last = now if s.prefill_tokens == 0 else None

    def median(self) -> float:
        return round(statistics.median(self.ms), 3) if self.ms else 0.0


# ------------------------------------------------------------------------ CPU: n-gram, default model


def section_cpu_ngram(ctx) -> dict:
    """Per prompt, a plain run then an n-gram run (``rounds`` times, both engines loaded), so
    that a busy machine slows both alike; tok/s from the summed wall times, and per CPU
    second of the process (steadier where other processes share the cores)."""
    loop, new = ctx["loop"], ctx["new"]
    res = {}
    engines = {"plain": make_cpu_engine(ctx, None), "spec": make_cpu_engine(ctx, "ngram")}
    if ctx.get("topk", 1) > 1:
        engines["tree"] = make_cpu_engine(ctx, "ngram", speculative_eagle_topk=ctx["topk"])
    try:
        sets = prompt_sets(engines["plain"])
        for eng in engines.values():
            loop.run_until_complete(generate(eng, sets["chat"][:1], 4))  # warm up
        for name, prompts in sets.items():
            wall = dict.fromkeys(engines, 0.0)
            cpu = dict.fromkeys(engines, 0.0)
            tokens = 0
            same = dict.fromkeys(engines, 0)
            before = {key: spec_counts(eng) for key, eng in engines.items() if key != "plain"}
            for p in prompts:
                last = {}
                for _ in range(ctx["rounds"]):
                    for key, eng in engines.items():
                        c = time.process_time()
                        got, secs = loop.run_until_complete(generate(eng, [p], new))
                        cpu[key] += time.process_time() - c
                        wall[key] += secs
                        last[key] = got[0]
                tokens += ctx["rounds"] * len(last["spec"])
                for key in engines:
                    same[key] += last["plain"] == last[key]
            r = {"prompts": len(prompts), "tokens_each_mode": tokens, "plain_tok_s": round(tokens / wall["plain"], 2)}
            for key, pre in before.items():  # "spec": chains; "tree": token trees
                tag = "" if key == "spec" else "tree_"
                after = spec_counts(engines[key])
                d = {k: after[k] - pre[k] for k in ("verifies", "drafted", "accepted")}
                r |= {f"{tag or 'spec_'}tok_s": round(tokens / wall[key], 2),
                      f"{tag}speedup": round(wall["plain"] / wall[key], 3),
                      f"{tag}speedup_cpu_time": round(cpu["plain"] / cpu[key], 3),
                      f"{tag}accepted_of_drafted": round(d["accepted"] / d["drafted"], 3) if d["drafted"] else 0.0,
                      f"{tag}tokens_per_verify": round((d["accepted"] + d["verifies"]) / d["verifies"], 3)
                      if d["verifies"] else 0.0,
                      f"{tag}same_outputs": same[key]}
            if "tree" in engines:
                r["tree_vs_chain"] = round(wall["spec"] / wall["tree"], 3)
                r["tree_vs_chain_cpu_time"] = round(cpu["spec"] / cpu["tree"], 3)
            res[name] = r
            ctx["log"](f"cpu ngram {name}: {r}")
    finally:
        for eng in engines.values():
            loop.run_until_complete(eng.stop())
    return res


def prompt_sets(eng: Engine) -> dict[str, list[list[int]]]:
    """The copy-heavy and the chat prompts through the model's chat template; without a
    tokenizer (``--quick``'s random model) token ids standing in for them: a passage that
    repeats, and text that does not."""
    if eng.tokenizer is not None:
        return {name: [eng.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
                for name, prompts in (("copy", COPY_PROMPTS), ("chat", CHAT_PROMPTS))}
    rng = random.Random(2)
    passage = [rng.randrange(100, 500) for _ in range(16)]
    return {"copy": [passage * 3 for _ in COPY_PROMPTS],
            "chat": [[rng.randrange(100, 500) for _ in range(48)] for _ in CHAT_PROMPTS]}


def make_cpu_engine(ctx, algorithm: str | None, **extra) -> Engine:
    kw = dict(CPU_ENGINE, kv_cache_tokens=16384, speculative_num_draft_tokens=ctx["k"], **extra)
    if algorithm:
        kw["speculative_algorithm"] = algorithm
    if ctx.get("random_weights"):
        kw.update(tokenizer="none", load_format="dummy")
    return Engine(model=ctx["model"], plugin_manager=builtin_plugins(), **kw)


# ------------------------------------------------------------------------ GPU sections (and --quick)


def section_verify(ctx) -> dict:
    """Median decode step time plain, then with k = 1..8 always-wrong drafts."""
    loop, prompts, new = ctx["loop"], ctx["prompts"][:1], ctx["new"]
    res = {"plain_step_ms": ctx["plain_step_ms"]}
    eng = ctx["spec"]
    for k in ctx["ks"]:  # (random drafts, none forced: every step verifies k and yields one token)
        eng.scheduler.speculator.max_k = k
        steps = Steps(eng)
        loop.run_until_complete(generate(eng, prompts, new))
        ms = steps.median()
        res[f"k{k}"] = {"step_ms": ms, "vs_decode": round(ms / ctx["plain_step_ms"], 3) if ctx["plain_step_ms"] else 0.0}
        ctx["log"](f"verify k={k}: {res[f'k{k}']}")
    eng.scheduler.speculator.max_k = K_DEFAULT
    return res


def section_accept(ctx) -> dict:
    """Batch-1 tok/s at each acceptance rate with K_DEFAULT drafts, against plain."""
    loop, prompts, new = ctx["loop"], ctx["prompts"], ctx["new"]
    eng = ctx["spec"]
    outs, secs = loop.run_until_complete(generate(ctx["plain"], prompts, new))  # plain again, as warm
    plain_tok_s = sum(map(len, outs)) / secs
    return {"plain_tok_s": round(plain_tok_s, 2), "k": K_DEFAULT,
            "rates": forced_rates(ctx, eng, ctx["rates"], plain_tok_s, "accept")}


def forced_rates(ctx, eng: Engine, rates, plain_tok_s: float, label: str) -> dict:
    """``ctx``'s prompts on ``eng`` with its acceptance forced to each rate in turn: tok/s
    against ``plain_tok_s``, and what the verifier took."""
    out = {}
    for p in rates:
        before = spec_counts(eng)
        with forced_acceptance(eng, p):
            outs, secs = ctx["loop"].run_until_complete(generate(eng, ctx["prompts"], ctx["new"]))
        after = spec_counts(eng)
        tok_s = sum(map(len, outs)) / secs
        v, d, a = (after[k] - before[k] for k in ("verifies", "drafted", "accepted"))
        out[str(p)] = case = {"tok_s": round(tok_s, 2), "speedup": round(tok_s / plain_tok_s, 3),
                              "accepted_of_drafted": round(a / d, 3) if d else 0.0,
                              "tokens_per_verify": round((a + v) / v, 3) if v else 0.0}
        ctx["log"](f"{label} p={p}: {case}")
    return out


def section_ngram(ctx) -> dict:
    loop, new = ctx["loop"], ctx["new"]
    rng = random.Random(3)
    prompts = [[rng.randrange(100, ctx["vocab_hi"]) for _ in range(24)] * 8 for _ in range(len(ctx["prompts"]))]
    out = {}
    for name, eng in (("plain", ctx["plain"]), ("ngram", ctx["ngram"])):
        before = spec_counts(eng)
        outs, secs = loop.run_until_complete(generate(eng, prompts, new))
        after = spec_counts(eng)
        out[name] = {"tok_s": round(sum(map(len, outs)) / secs, 2),
                     "accepted_of_drafted": round((after["accepted"] - before["accepted"])
                                                  / max(1, after["drafted"] - before["drafted"]), 3)}
    out["speedup"] = round(out["ngram"]["tok_s"] / out["plain"]["tok_s"], 3)
    ctx["log"](f"ngram: {out}")
    return out


def section_batch(ctx) -> dict:
    """``batch`` requests at once: plain, p = 0.7 with speculation stepping aside, p = 0.7 forced."""
    loop, new, b = ctx["loop"], ctx["new"], ctx["batch"]
    rng = random.Random(5)
    prompts = [[rng.randrange(100, ctx["vocab_hi"]) for _ in range(64)] for _ in range(b)]
    plain_outs, secs = loop.run_until_complete(generate(ctx["plain"], prompts, new, concurrent=True))
    res = {"batch": b, "plain_tok_s": round(b * new / secs, 1)}
    eng = ctx["spec"]
    spec = eng.scheduler.speculator
    for name, max_batch in (("steps_aside", ctx["max_batch"]), ("forced", 0)):
        spec.max_batch = max_batch
        before = spec_counts(eng)
        with forced_acceptance(eng, 0.7):
            _, secs = loop.run_until_complete(generate(eng, prompts, new, concurrent=True))
        after = spec_counts(eng)
        v, a = after["verifies"] - before["verifies"], after["accepted"] - before["accepted"]
        res[name] = {"tok_s": round(b * new / secs, 1), "vs_plain": round(b * new / secs / res["plain_tok_s"], 3),
                     "verifies": v, "tokens_per_verify": round((a + v) / v, 3) if v else 0.0}
    spec.max_batch = ctx["max_batch"]
    ctx["log"](f"batch: {res}")
    return res


def section_standalone(ctx) -> dict:
    """Batch 1 with the ``standalone`` drafter whose draft model is the target's own checkpoint
    (the same seeded random weights): acceptance near 1, paying a second model's reads."""
    loop, prompts, new = ctx["loop"], ctx["prompts"], ctx["new"]
    eng = gpu_bench.engine(ctx["path"], plugin_manager=builtin_plugins(), speculative_algorithm="standalone",
                           speculative_draft_model_path=ctx["path"], speculative_draft_kv_tokens=16384,
                           speculative_num_draft_tokens=K_DEFAULT, speculative_adaptive=False, **ctx["engine_kw"])
    try:
        loop.run_until_complete(generate(eng, prompts[:1], 8))
        before = spec_counts(eng)
        outs, secs = loop.run_until_complete(generate(eng, prompts, new))
        after = spec_counts(eng)
    finally:
        loop.run_until_complete(eng.stop())
    v, d, a = (after[k] - before[k] for k in ("verifies", "drafted", "accepted"))
    tok_s = sum(map(len, outs)) / secs
    res = {"tok_s": round(tok_s, 2), "speedup": round(tok_s / ctx["plain_tok_s"], 3),
           "accepted_of_drafted": round(a / d, 3) if d else 0.0, "tokens_per_verify": round((a + v) / v, 3) if v else 0.0,
           "same_outputs": sum(o == t for o, t in zip(outs, ctx["truth"], strict=True))}
    ctx["log"](f"standalone (draft = target): {res}")
    return res


def section_tree(ctx) -> dict:
    """Median decode step time with random token trees of ``w`` branches of depth
    ``K_DEFAULT`` (w = 2..4), against plain decode steps."""
    loop, prompts, new = ctx["loop"], ctx["prompts"][:1], ctx["new"]
    res = {"plain_step_ms": ctx["plain_step_ms"], "depth": K_DEFAULT}
    widths = (2, 4) if ctx["quick"] else (2, 3, 4)
    eng = gpu_bench.engine(ctx["path"], plugin_manager=builtin_plugins(extra=[AtRatePlugin()]),
                           speculative_algorithm="at-rate-tree", speculative_eagle_topk=max(widths),
                           speculative_num_draft_tokens=K_DEFAULT, speculative_adaptive=False, **ctx["engine_kw"])
    try:
        loop.run_until_complete(generate(eng, prompts, 8))  # warm up
        for w in widths:
            AtRateTree.width = w
            before = eng.stats().get("spec_tree_verifies", 0)
            steps = Steps(eng)
            loop.run_until_complete(generate(eng, prompts, new))
            ms = steps.median()
            res[f"w{w}"] = {"nodes": w * K_DEFAULT, "step_ms": ms,
                            "vs_decode": round(ms / ctx["plain_step_ms"], 3) if ctx["plain_step_ms"] else 0.0,
                            "tree_verifies": eng.stats().get("spec_tree_verifies", 0) - before}
            ctx["log"](f"tree w={w}: {res[f'w{w}']}")
    finally:
        loop.run_until_complete(eng.stop())
    return res


def eagle3_head_dir(shape: dict, *, draft_vocab: int = 32000, seed: int = 0) -> str:
    """An EAGLE-3 head for a target of ``shape`` in SGLang's layout (``LlamaForCausalLMEagle3``:
    fc, midlayer.*, norm, lm_head, d2t, t2d), bf16 weights drawn N(0, 0.02) (norms 1), a
    random draft vocabulary, in a new temporary directory. A target of fewer than 8 layers
    gets its layers 0, L/2 and L - 1 (SGLang's default needs more)."""
    from safetensors.torch import save_file

    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd, inter = h // heads, shape["intermediate_size"]
    vd = min(draft_vocab, vocab)
    gen = torch.Generator().manual_seed(seed)

    def rand(*dims):
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    ids = torch.randperm(vocab, generator=gen)[:vd].sort().values
    tensors = {"fc.weight": rand(h, 3 * h), "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * hd, 2 * h),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * hd, 2 * h),
               "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
               "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
               "midlayer.mlp.down_proj.weight": rand(h, inter), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": rand(vd, h), "d2t": ids - torch.arange(vd),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
    d = Path(tempfile.mkdtemp(prefix="radixd-eagle3-head-"))
    save_file(tensors, str(d / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "draft_vocab_size": vd, "rms_norm_eps": 1e-5,
              "max_position_embeddings": shape["max_position_embeddings"], "rope_theta": shape["rope_theta"],
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if layers < 8:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def section_eagle3(ctx) -> dict:
    """The ``eagle3`` drafter with a random head (see the module docstring): its drafts miss,
    so the unforced run measures what drafting and verifying cost per step."""
    loop, prompts, new, b = ctx["loop"], ctx["prompts"], ctx["new"], ctx["batch"]
    shape = json.loads((Path(ctx["path"]) / "config.json").read_text())
    head = eagle3_head_dir(shape)
    eng = gpu_bench.engine(ctx["path"], plugin_manager=builtin_plugins(), speculative_algorithm="eagle3",
                           speculative_draft_model_path=head, speculative_draft_kv_tokens=65536,
                           speculative_num_draft_tokens=K_DEFAULT, speculative_adaptive=False,
                           speculative_max_batch=ctx["max_batch"], speculative_eagle_topk=ctx["eagle3_topk"],
                           **ctx["engine_kw"])
    res: dict = {"topk": ctx["eagle3_topk"], "k": K_DEFAULT}
    try:
        loop.run_until_complete(generate(eng, prompts[:1], 8))  # warm up
        steps = Steps(eng)
        before = spec_counts(eng)
        outs, secs = loop.run_until_complete(generate(eng, prompts, new))
        after = spec_counts(eng)
        eng.stats_hook = None
        tok_s = sum(map(len, outs)) / secs
        v, d, a = (after[k] - before[k] for k in ("verifies", "drafted", "accepted"))
        res["unforced"] = {"tok_s": round(tok_s, 2), "vs_plain": round(tok_s / ctx["plain_tok_s"], 3),
                           "step_ms": steps.median(),
                           "step_vs_decode": round(steps.median() / ctx["plain_step_ms"], 3) if ctx["plain_step_ms"] else 0.0,
                           "verifies": v, "accepted_of_drafted": round(a / d, 3) if d else 0.0}
        ctx["log"](f"eagle3 unforced: {res['unforced']}")
        res["rates"] = forced_rates(ctx, eng, ctx["eagle3_rates"], ctx["plain_tok_s"], "eagle3")
        rng = random.Random(5)
        many = [[rng.randrange(100, ctx["vocab_hi"]) for _ in range(64)] for _ in range(b)]
        _, plain_secs = loop.run_until_complete(generate(ctx["plain"], many, new, concurrent=True))
        before = spec_counts(eng)
        _, secs = loop.run_until_complete(generate(eng, many, new, concurrent=True))
        after = spec_counts(eng)
        res["batch"] = {"batch": b, "plain_tok_s": round(b * new / plain_secs, 1), "tok_s": round(b * new / secs, 1),
                        "vs_plain": round(plain_secs / secs, 3), "verifies": after["verifies"] - before["verifies"]}
        ctx["log"](f"eagle3 batch: {res['batch']}")
    finally:
        loop.run_until_complete(eng.stop())
        import shutil

        shutil.rmtree(head, ignore_errors=True)
    return res


GPU_SECTIONS = {"verify": section_verify, "accept": section_accept, "ngram": section_ngram, "batch": section_batch,
                "standalone": section_standalone, "tree": section_tree, "eagle3": section_eagle3}


def run_model_sections(args, ctx) -> dict:
    """The sections over random weights (``--device cuda``, or ``--quick`` on the CPU)."""
    loop = ctx["loop"]
    if args.quick:
        gpu_bench.DEVICE["name"] = "cpu"
        shape = dict(SHAPES["smollm2-135m"], num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        path = ctx["tiny"] = checkpoint_dir(shape, prefix="radixd-spec-quick-")
        kw = dict(kv_cache_tokens=8192)
    else:
        path = gpu_bench.model_dir(args.model)
        kw = dict(kv_cache_tokens=60_000)  # three 8B engines side by side
    kw["max_running_requests"] = max(64, ctx["batch"])
    ctx["path"], ctx["engine_kw"], ctx["quick"] = path, kw, args.quick
    rng = random.Random(1)
    ctx["vocab_hi"] = 500 if args.quick else gpu_bench.VOCAB_HI  # random prompt ids below the vocabulary
    ctx["prompts"] = [[rng.randrange(100, ctx["vocab_hi"]) for _ in range(48 if args.quick else 512)]
                      for _ in range(args.prompts)]
    AtRate.vocab = ctx["vocab_hi"]
    plugins = builtin_plugins(extra=[AtRatePlugin()])
    ctx["plain"] = gpu_bench.engine(path, plugin_manager=plugins, **kw)
    steps = Steps(ctx["plain"])
    loop.run_until_complete(generate(ctx["plain"], ctx["prompts"][:1], 8))  # warm up
    outs, secs = loop.run_until_complete(generate(ctx["plain"], ctx["prompts"], ctx["new"]))
    ctx["truth"] = outs
    ctx["plain_tok_s"] = round(sum(map(len, outs)) / secs, 2)
    ctx["plain_step_ms"] = steps.median()
    ctx["plain"].stats_hook = None
    spec_kw = dict(speculative_num_draft_tokens=K_DEFAULT, speculative_adaptive=False,
                   speculative_max_batch=ctx["max_batch"])
    ctx["spec"] = gpu_bench.engine(path, plugin_manager=plugins, speculative_algorithm="at-rate", **spec_kw, **kw)
    ctx["ngram"] = gpu_bench.engine(path, plugin_manager=plugins, speculative_algorithm="ngram", **kw)
    for eng in (ctx["spec"], ctx["ngram"]):
        loop.run_until_complete(generate(eng, ctx["prompts"][:1], 8))
    spec_outs, _ = loop.run_until_complete(generate(ctx["spec"], ctx["prompts"], ctx["new"]))  # exact: none forced
    out = {"model": "tiny" if args.quick else args.model, "plain_tok_s": ctx["plain_tok_s"],
           "plain_step_ms": ctx["plain_step_ms"],
           "verify_rows_vs_plain": {"same_outputs": sum(a == b for a, b in zip(spec_outs, outs, strict=True)),
                                    "first_difference": [next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                                               if x != y), None) for a, b in zip(spec_outs, outs, strict=True)]}}
    try:
        for name in args.sections:
            if name in GPU_SECTIONS:
                out[name] = timed_section(lambda name=name: GPU_SECTIONS[name](ctx))
                free()  # the section's own engine (standalone: two 8B models) before the next one's
    finally:
        for key in ("plain", "spec", "ngram"):
            loop.run_until_complete(ctx[key].stop())
            ctx[key] = None
        free()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="every section on tiny random models, on the CPU (a smoke run)")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES), help="cuda: the shape (random weights)")
    ap.add_argument("--cpu-model", default="default", help="cpu: the checkpoint of the n-gram section")
    ap.add_argument("--sections", default="", help="default: ngram on cpu; verify,accept,ngram,batch,standalone,tree,"
                    "eagle3 on cuda")
    ap.add_argument("--new", type=int, default=0, help="tokens per request (default 64 cpu, 256 cuda, 12 quick)")
    ap.add_argument("--prompts", type=int, default=0, help="cuda: prompts per batch-1 run (default 4, quick 2)")
    ap.add_argument("--eagle-topk", type=int, default=1, help="cpu: also n-gram token trees of this width (> 1)")
    ap.add_argument("--rounds", type=int, default=1, help="cpu: runs of each prompt per engine, alternating")
    ap.add_argument("--eagle3-topk", type=int, default=1, help="eagle3: the head's token trees' width (1: chains)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda" and not args.quick
    args.sections = [s for s in (args.sections or ("verify,accept,ngram,batch,standalone,tree,eagle3" if cuda or args.quick
                                                   else "ngram")
                                 ).split(",") if s]
    args.prompts = args.prompts or (2 if args.quick else 4)
    ctx = {"loop": asyncio.new_event_loop(), "log": Log(Path(args.out) / "spec.log"), "k": K_DEFAULT,
           "rounds": args.rounds, "topk": args.eagle_topk,
           "max_batch": 2 if args.quick else 8, "ks": (1, 4, 8) if args.quick else range(1, 9),
           "rates": (0.5, 1.0) if args.quick else RATES, "eagle3_topk": args.eagle3_topk,
           "eagle3_rates": (0.7,) if args.quick else (0.5, 0.7, 0.9),
           "new": args.new or (12 if args.quick else 256 if cuda else 64), "batch": 4 if args.quick else 64}
    summary: dict = {"environment": environment(), "k": K_DEFAULT}
    if cuda or args.quick:
        summary["gpu" if cuda else "quick"] = run_model_sections(args, ctx)
    if not cuda:
        ctx["model"] = ctx["tiny"] if args.quick else args.cpu_model
        ctx["random_weights"] = args.quick
        summary["cpu_ngram"] = timed_section(lambda: section_cpu_ngram(ctx))
    write_json(Path(args.out) / f"spec_{'cuda' if cuda else 'cpu'}{'_quick' if args.quick else ''}.json", summary)
    ctx["loop"].close()
    return 0



if __name__ == "__main__":
    sys.exit(main())
