"""EAGLE-3 draft heads (``speculative.algorithm = "eagle3"``): heads written here in SGLang's
checkpoint layout (``LlamaForCausalLMEagle3``: fc, midlayer.*, norm, lm_head, d2t, t2d) for
tiny random Llama targets. Greedy and seeded sampled output equal plain decoding's (requests
arriving mid-flight, chunked prefill, a cached prefix, token trees, n > 1, stop strings,
logprobs, penalties; the torch and Triton attention backends); the streams a head reads are
the target's residual streams after the configured layers (transformers' hidden states); a
head that copies the last layer's stream drafts exactly the target's last pick, and one
built to predict a walk has exactly its first draft accepted each verify; bad heads are
refused naming the tensor or field; no KV slot or row leaks (finished, aborted, preempted);
the SGLang launch flag maps."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from conftest import _tokenizer, hf_greedy
from test_engine import assert_idle
from test_speculative import run_calls, run_constrained, same_outputs

from radixd import Engine, SamplingParams, launch_flags
from radixd.cli import build_parser
from radixd.core.errors import ConfigError
from radixd.core.model_loader import read_config
from radixd.core.speculative.eagle3_head import default_layers, read_head

H, V, LAYERS, VD = 64, 256, 4, 32  # the targets' hidden size, vocabulary, layers; a walk's tokens


def make_target(path: Path, seed: int, walk: list[int] | None = None, noise: float = 0.0) -> Path:
    """A random Llama of ``LAYERS`` layers; with ``walk`` (a cycle of tokens) one whose greedy
    next token after walk[j] is walk[j + 1]: attention and MLP outputs ~``noise`` (0: none),
    embeddings of equal norm, the LM head's row of walk[j + 1] walk[j]'s embedding."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, vocab_size=V, eos_token_id=0,
                      pad_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
        if walk is not None:
            m = model.model
            e = m.embed_tokens.weight
            e.copy_(e / e.norm(dim=1, keepdim=True) * H**0.5)  # (RMS 1: a norm leaves them as they are)
            for layer in m.layers:
                layer.self_attn.o_proj.weight.normal_(0, noise)
                layer.mlp.down_proj.weight.normal_(0, noise)
            model.lm_head.weight.zero_()
            for a, b in zip(walk, walk[1:] + walk[:1], strict=True):
                model.lm_head.weight[b] = e[a] / H**0.5
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def target_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def write_head(path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """An EAGLE-3 head checkpoint in SGLang's layout: these tensors and a config.json of the
    tiny targets' shape (``config`` overrides its fields)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, LAYERS - 1], "use_aux_hidden_state": True}}
    (path / "config.json").write_text(json.dumps({**conf, **(config or {})}))
    return path


def head_tensors(seed: int, *, fc: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None, quiet: bool = False) -> dict[str, torch.Tensor]:
    """A head's tensors: random, or with ``fc``, ``lm_head`` (None with ``draft_ids`` None:
    the target's) and the draft vocabulary's target ids (d2t, t2d); ``quiet``: its attention
    and MLP add nothing to the stream (o_proj and down_proj zero)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    t = {"fc.weight": rand(H, 3 * H) if fc is None else fc,
         "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
         "midlayer.self_attn.q_proj.weight": rand(64, 2 * H), "midlayer.self_attn.k_proj.weight": rand(32, 2 * H),
         "midlayer.self_attn.v_proj.weight": rand(32, 2 * H),
         "midlayer.self_attn.o_proj.weight": torch.zeros(H, 64) if quiet else rand(H, 64),
         "midlayer.post_attention_layernorm.weight": torch.ones(H),
         "midlayer.mlp.gate_proj.weight": rand(96, H), "midlayer.mlp.up_proj.weight": rand(96, H),
         "midlayer.mlp.down_proj.weight": torch.zeros(H, 96) if quiet else rand(H, 96),
         "norm.weight": torch.ones(H)}
    if draft_ids is not None:
        t["lm_head.weight"] = rand(len(draft_ids), H) if lm_head is None else lm_head
        t["d2t"] = draft_ids - torch.arange(len(draft_ids))
        t["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, draft_ids, True)
    return t


@pytest.fixture(scope="module")
def walk() -> list[int]:
    rng = random.Random(7)
    return rng.sample(range(2, V), VD)


@pytest.fixture(scope="module")
def models(tmp_path_factory, walk) -> dict[str, Path]:
    """Targets (a random one; a walk with noisy attention and MLPs; a pure walk; a walk over
    the letters a-e) and heads (random, with a draft vocabulary of 64; one copying the last
    layer's stream; ones predicting a walk two tokens on, over the walk's tokens)."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {"random": make_target(root / "random", 0), "noisy": make_target(root / "noisy", 1, walk, noise=0.01),
           "walk": make_target(root / "walk", 1, walk)}
    ids = torch.tensor(sorted(random.Random(3).sample(range(V), 64)))
    out["head"] = write_head(root / "head", head_tensors(5, draft_ids=ids))
    (out["head"] / "vocab.json").write_text(json.dumps(ids.tolist()))  # (for the test, not the loader)
    # copy: fc passes the third stream (after the last layer) through, norm the target's, no
    # LM head (the target's): its logits at position t are the target's there
    norm = target_weights(out["random"])["model.norm.weight"]
    copy = head_tensors(6, fc=torch.cat((torch.zeros(H, 2 * H), torch.eye(H)), 1), quiet=True)
    out["copy"] = write_head(root / "copy", {**copy, "norm.weight": norm})
    out["walk_head"] = walk_head(root / "walk_head", out["walk"], walk)
    letters = _tokenizer().convert_tokens_to_ids(list("abcde"))  # (a walk a grammar of letters allows)
    out["letters"] = make_target(root / "letters", 2, letters)
    out["letters_head"] = walk_head(root / "letters_head", out["letters"], letters)
    return out


def walk_head(path: Path, target: Path, walk: list[int]) -> Path:
    """A head predicting ``target``'s walk two tokens on: fc maps each walk token's embedding
    onto its successor's (exact: at most 64 points in 64 dimensions), and its LM head over
    the walk's tokens (d2t) picks the successor of what it is given."""
    e = target_weights(target)["model.embed_tokens.weight"]
    nxt = dict(zip(walk, walk[1:] + walk[:1], strict=True))
    prev = {b: a for a, b in nxt.items()}
    q = torch.linalg.lstsq(e[walk].double(), e[[nxt[t] for t in walk]].double()).solution.T.float()
    draft = torch.tensor(sorted(walk))
    lm = torch.stack([e[prev[int(t)]] for t in draft]) / H**0.5
    fc = torch.cat((q, torch.zeros(H, 2 * H)), 1)
    return write_head(path, head_tensors(7, fc=fc, lm_head=lm, draft_ids=draft, quiet=True),
                      {"draft_vocab_size": len(walk)})


def engine(path: Path, head: Path | None = None, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 2048)
    if head is not None:
        kw |= {"speculative_algorithm": "eagle3", "speculative_draft_model_path": str(head),
               "speculative_draft_kv_tokens": 512}
    eng = Engine(model=str(path), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


def drafter_idle(eng: Engine) -> None:
    """The head holds no request's state, KV slot or table row."""
    d = eng.scheduler.speculator.drafter
    assert d.states == {}
    assert d.allocator.available == d.allocator.total
    assert len(d.rows._free) == eng.config.max_running_requests


async def staggered(eng: Engine, calls: list[tuple[list[int], dict]], gap_steps: int = 3) -> list[list]:
    """``run_calls`` with call i submitted once the engine has run ``i * gap_steps`` steps
    (later requests join a batch that is decoding and verifying)."""
    steps = [0]
    hook = eng.step_hook
    changed = asyncio.Event()

    def count(step):
        hook(step)
        steps[0] += 1
        changed.set()

    eng.step_hook = count

    async def one(i, call):
        while steps[0] < i * gap_steps:
            changed.clear()
            await changed.wait()
        return (await run_calls(eng, [call]))[0]

    try:
        return await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
    finally:
        eng.step_hook = hook


async def plain_and_eagle(target: Path, head: Path, calls, **kw):
    outs = []
    for h in (None, head):
        eng = engine(target, h, **kw)
        try:
            outs.append(await staggered(eng, calls))
            await assert_idle(eng)
            if h is not None:
                drafter_idle(eng)
                stats = eng.stats()
        finally:
            await eng.stop()
    return outs[0], outs[1], stats


def walk_prompts(walk: list[int], n: int, seed: int) -> list[list[int]]:
    """Prompts of walk tokens in random order, ending on a stretch of the walk."""
    rng = random.Random(seed)
    return [[rng.choice(walk) for _ in range(9 + 4 * i)] + walk[i : i + 3] for i in range(n)]


@pytest.mark.parametrize("topk", [1, 2])
async def test_greedy_equals_plain(models, walk, topk):
    """A head whose first draft is right and the rest wrong, on a target whose attention and
    MLPs matter: tokens and logprobs equal plain decoding's, with requests arriving while
    others verify, prompts chunked 5 tokens at a time, and a prompt served from the cache (the
    head starts past it)."""
    ps = walk_prompts(walk, 3, seed=1)
    calls = [(p, {"max_new_tokens": 16, "logprobs": True}) for p in ps] + [(ps[0], {"max_new_tokens": 12})]
    plain, spec, st = await plain_and_eagle(models["noisy"], models["walk_head"], calls, chunked_prefill_size=5,
                                            speculative_eagle_topk=topk)
    same_outputs(plain, spec)
    assert st["spec_verifies"] > 0 and 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert st["cache_hit_tokens"] >= len(ps[0]) - 1
    if topk > 1:
        assert st["spec_tree_verifies"] > 0


async def test_sampled_equals_plain(models, walk):
    """Seeded sampling (temperature, top-p, a repetition penalty, n = 2, a stop string,
    logprobs) gives plain decoding's tokens, text, finish reasons and logprobs."""
    ps = walk_prompts(walk, 2, seed=2)
    base = {"temperature": 1.3, "top_p": 0.95, "seed": 11, "logprobs": True, "max_new_tokens": 14}
    calls = [(ps[0], {**base, "n": 2}), (ps[1], {**base, "repetition_penalty": 1.2, "stop": ["e"]}),
             (ps[0][:6], {**base, "seed": 3, "temperature": 0.8})]
    plain, spec, st = await plain_and_eagle(models["noisy"], models["walk_head"], calls)
    same_outputs(plain, spec)
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]


async def test_grammars_equal_plain(models):
    """Constrained requests (a regex, greedy; a JSON schema, sampled): the head's drafts are
    walked on a fork of the matcher and cut where the grammar refuses them; output equals
    plain decoding's."""
    rng = random.Random(13)
    cases = [([rng.randrange(2, V) for _ in range(9)],
              SamplingParams(max_new_tokens=20, regex="[a-e]{3,8}( [a-e]{2,6}){2,4}\\.", temperature=0.0)),
             ([rng.randrange(2, V) for _ in range(11)],
              SamplingParams(max_new_tokens=20, json_schema='{"type": "object", "properties": {"a": '
                             '{"type": "integer"}}, "required": ["a"]}', temperature=0.9, seed=3))]
    results = []
    for head in (None, models["letters_head"]):
        eng = engine(models["letters"], head, grammar_compile_memory_mb=0)
        try:
            results.append([await run_constrained(eng, p, params) for p, params in cases])
            st = eng.stats()
        finally:
            await eng.stop()
    assert results[1] == results[0] and results[0][0][2] == "stop"
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] > 0


async def test_triton_backend_equals_plain(models, walk):
    """The Triton attention kernels (interpreted on the CPU: slow, so one short request) for
    the target and the head give plain decoding's tokens and logprobs (plain on the torch
    backend: float32 either way)."""
    calls = [(walk[:4], {"max_new_tokens": 5, "logprobs": True})]
    eng = engine(models["noisy"], models["walk_head"], attention_backend="triton")
    try:
        spec = await run_calls(eng, calls)
        st = eng.stats()
        await assert_idle(eng)
    finally:
        await eng.stop()
    plain_eng = engine(models["noisy"])
    try:
        same_outputs(await run_calls(plain_eng, calls), spec)
    finally:
        await plain_eng.stop()
    assert st["spec_accepted_tokens"] > 0


async def test_streams_are_the_targets_hidden_states(models):
    """What a head reads at a prompt's positions: the residual stream after each configured
    layer, which transformers reports as its hidden states (the last one normed there)."""
    from transformers import AutoModelForCausalLM

    eng = engine(models["random"], models["copy"])
    d = eng.scheduler.speculator.drafter
    got = []
    orig = d.features
    d.features = lambda spans, aux: (got.append((list(spans), aux.clone())), orig(spans, aux))
    p = random.Random(5).sample(range(2, V), 12)
    try:
        await run_calls(eng, [(p, {"max_new_tokens": 1})])
    finally:
        await eng.stop()
    (span,), aux = got[0]
    assert (span.start, span.count) == (0, len(p)) and aux.shape == (len(p), 3 * H)
    hf = AutoModelForCausalLM.from_pretrained(models["random"], dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([p]), output_hidden_states=True).hidden_states  # [0]: embeddings
    torch.testing.assert_close(aux[:, :H], hs[1][0], atol=1e-4, rtol=1e-4)          # after layer 0
    torch.testing.assert_close(aux[:, H : 2 * H], hs[2][0], atol=1e-4, rtol=1e-4)   # after layer 1
    torch.testing.assert_close(hf.model.norm(aux[:, 2 * H :]), hs[LAYERS][0], atol=1e-4, rtol=1e-4)  # the last


async def test_copy_head_drafts_the_last_pick(models):
    """A head whose output is the target's last stream at its position (fc passing it
    through, the target's norm and LM head): the stream it is given for position t is the
    target's at t, paired with token t + 1, so its first draft is the target's greedy pick
    after all but the last token: the last token itself once the target picked it, in every
    call (transformers' pick after a prompt less its last token, before any)."""
    eng = engine(models["random"], models["copy"], chunked_prefill_size=7)
    d = eng.scheduler.speculator.drafter
    seen = []
    orig = d.propose

    def spy(reqs, ks):
        out = orig(reqs, ks)
        seen.extend((r.prompt_ids, r.output_ids[:], list(o)) for r, o in zip(reqs, out, strict=True))
        return out

    d.propose = spy
    rng = random.Random(6)
    calls = [([rng.randrange(2, V) for _ in range(15 + 4 * i)], {"max_new_tokens": 10}) for i in range(3)]
    try:
        await staggered(eng, calls)
    finally:
        await eng.stop()
    assert len(seen) > 10 and all(draft for _, _, draft in seen)
    for prompt, out, draft in seen:
        last = out[-1] if out else hf_greedy(models["random"], prompt[:-1], 1)[0][0]
        assert draft == [last] * len(draft)


async def test_trees_grow_by_beams(models):
    """``eagle_topk`` = 3, depth k <= 3: each tree is the 3k best-scored of the beams' candidates,
    its first depth the head's 3 likeliest tokens best first (for the copying head: the
    target's after all but the last token, per transformers); deeper nodes branch off other
    nodes than the first chain (every beam's children are candidates), and a node's score
    never beats its parent's (children listed after parents, best first)."""
    from transformers import AutoModelForCausalLM

    from radixd.core.speculative.tree import TokenTree

    eng = engine(models["random"], models["copy"], speculative_eagle_topk=3, speculative_num_draft_tokens=3,
                 speculative_adaptive=False)
    d = eng.scheduler.speculator.drafter
    seen = []
    orig = d.propose

    def spy(reqs, ks):
        out = orig(reqs, ks)
        seen.extend((r.seq, k, o) for r, k, o in zip(reqs, ks, out, strict=True))
        return out

    d.propose = spy
    rng = random.Random(12)
    calls = [([rng.randrange(2, V) for _ in range(10 + 5 * i)], {"max_new_tokens": 8}) for i in range(2)]
    try:
        spec = await run_calls(eng, calls)
        stats = eng.stats()
    finally:
        await eng.stop()
    hf = AutoModelForCausalLM.from_pretrained(models["random"], dtype=torch.float32)
    off_chain = 0
    for seq, k, tree in seen:
        assert isinstance(tree, TokenTree) and len(tree) == 3 * k and max(tree.depths) <= k
        with torch.no_grad():
            want = hf(torch.tensor([seq[:-1]])).logits[0, -1].topk(3).indices.tolist()
        assert [t for t, p in zip(tree, tree.parents, strict=True) if p < 0] == want
        chain = set(tree.path(len(tree.first_path()) - 1)) if tree.first_path() else set()
        off_chain += any(dep >= 2 and p not in chain for dep, p in zip(tree.depths, tree.parents, strict=True))
        assert all(p < i for i, p in enumerate(tree.parents))
    assert len(seen) >= 4 and any(k == 3 for _, k, _ in seen) and off_chain > 0 and stats["spec_tree_verifies"] > 0
    plain_eng = engine(models["random"])
    try:
        same_outputs(await run_calls(plain_eng, calls), spec)
    finally:
        await plain_eng.stop()


async def test_walk_head_has_its_first_draft_accepted(models, walk):
    """On a target that walks a cycle of tokens, a head mapping the target's stream at t
    onto its pick two tokens on (through d2t: draft ids are the walk's tokens in order)
    drafts the next token right; its chain then repeats it, which the walk never does: every
    verify accepts exactly one draft."""
    calls = [(walk_prompts(walk, 1, seed=8)[0], {"max_new_tokens": 20}), (walk[5:9], {"max_new_tokens": 12})]
    plain, spec, st = await plain_and_eagle(models["walk"], models["walk_head"], calls, speculative_adaptive=False,
                                            speculative_num_draft_tokens=3)
    same_outputs(plain, spec)
    nxt = dict(zip(walk, walk[1:] + walk[:1], strict=True))
    toks = spec[0][0][0]
    assert all(nxt[a] == b for a, b in zip(toks, toks[1:], strict=False))  # (the target walks)
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] == st["spec_verifies"]


async def test_head_steps_aside_with_the_speculation(models, walk, monkeypatch):
    """Past ``speculative_max_batch`` decoding requests nothing drafts, and the head does not
    follow their decode rows either (a compute-bound batch pays nothing for it): their states
    go; once the batch is small again the head starts them over and drafts are accepted.
    Output equals plain decoding's, and the head holds nothing at the end."""
    from radixd.core.speculative.eagle3 import Eagle3Drafter

    followed: list[int] = []
    features = Eagle3Drafter.features
    monkeypatch.setattr(Eagle3Drafter, "features",
                        lambda self, spans, aux: followed.append(len(spans)) or features(self, spans, aux))
    calls = [(walk_prompts(walk, 1, seed=9)[0], {"max_new_tokens": 24}), (walk[2:7], {"max_new_tokens": 6}),
             (walk[4:9], {"max_new_tokens": 6})]
    plain, spec, st = await plain_and_eagle(models["walk"], models["walk_head"], calls, speculative_adaptive=False,
                                            speculative_num_draft_tokens=3, speculative_max_batch=1)
    same_outputs(plain, spec)
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] > 0
    assert 0 < len(followed) < st["steps"]  # (the steps aside followed nothing)


async def test_no_kv_left_after_finish_abort_and_preemption(models, walk):
    """The head's slots and rows come back when requests finish, are aborted mid-stream or
    preempted (a pool too small for the batch), as do the target's."""
    ps = walk_prompts(walk, 4, seed=9)
    eng = engine(models["noisy"], models["walk_head"], kv_cache_tokens=72, schedule_conservativeness=0.0)
    d = eng.scheduler.speculator.drafter
    held = []
    hook = eng.step_hook

    def check(step):
        hook(step)
        used = sum(st.slots.numel() for st in d.states.values())
        assert d.allocator.available + used == d.allocator.total  # (nothing else holds a slot between steps)
        assert all(st.slots.numel() == st.end - st.base for st in d.states.values())
        held.append(len(d.states))

    eng.step_hook = check

    async def aborted(p):
        got = 0
        async for out in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                         ignore_eos=True)):
            got += len(out.token_ids)
            if got >= 4:
                break  # (closes the submission: the request is aborted)

    try:
        await asyncio.gather(aborted(ps[0]), run_calls(eng, [(p, {"max_new_tokens": 24}) for p in ps[1:]]))
        await asyncio.sleep(0.05)
        stats = eng.stats()
        await assert_idle(eng)
        drafter_idle(eng)
    finally:
        await eng.stop()
    assert stats["preemptions"] > 0 and max(held) >= 2 and stats["spec_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,topk", [("float32", 1), ("bfloat16", 1), ("float32", 2)])
async def test_on_the_gpu_with_decode_graphs(models, walk, dtype, topk):
    """On a GPU: the target's verify and decode steps replay its decode graphs (tree verify
    steps too), which then hand back the streams (copied out of the graph's buffers), the
    head runs on the Triton backend (one-row steps fused); the walk head still has its first
    draft accepted each verify (exactly that with chains), and output equals plain decoding's."""
    kw = dict(device="cuda", attention_backend="triton", dtype=dtype, cuda_graphs=True, speculative_adaptive=False,
              speculative_num_draft_tokens=3, speculative_eagle_topk=topk)
    calls = [(walk_prompts(walk, 1, seed=8)[0], {"max_new_tokens": 24}), (walk[3:9], {"max_new_tokens": 16}),
             (walk_prompts(walk, 2, seed=3)[1], {"max_new_tokens": 20})]
    plain, spec, st = await plain_and_eagle(models["walk"], models["walk_head"], calls, **kw)
    same_outputs(plain, spec, logprob_tol=1e-2)
    assert st["spec_verifies"] > 0 and st["spec_accepted_tokens"] >= st["spec_verifies"]
    if topk == 1:
        assert st["spec_accepted_tokens"] == st["spec_verifies"]
    eng = engine(models["walk"], models["walk_head"], **kw)
    graphed = []
    eng.step_hook = lambda step: graphed.append(eng.worker.graphs.can_run(step.batch)) if step.drafts else None
    try:
        await run_calls(eng, calls[:1])
    finally:
        await eng.stop()
    assert graphed and all(graphed)


def test_bad_heads_are_refused(models, tmp_path):
    """A head that does not fit the model: the error names the tensor or field and what was
    expected (read from config.json and the safetensors headers, before any weights load)."""
    cfg = read_config(models["random"])
    ok = head_tensors(1, draft_ids=torch.arange(64))
    assert read_head(write_head(tmp_path / "ok", ok), cfg).layers == (0, 1, LAYERS - 1)
    drop = {k: v for k, v in ok.items() if k != "midlayer.mlp.up_proj.weight"}
    cases = [
        (drop, {}, r"'midlayer.mlp.up_proj.weight' is missing \(expected shape \[96, 64\]\)"),
        ({**ok, "fc.weight": torch.zeros(H, 3 * 32)}, {}, r"'fc.weight' has shape \[64, 96\]: expected \[64, 192\]"),
        (ok, {"target_hidden_size": 32}, "target hidden size 32: expected the model's 64"),
        ({**ok, "d2t": torch.zeros(60, dtype=torch.int64)}, {}, r"'d2t' has shape \[60\]: expected \[64\]"),
        ({**ok, "t2d": torch.zeros(100, dtype=torch.bool)}, {}, r"'t2d' has shape \[100\]: expected \[256\]"),
        ({k: v for k, v in ok.items() if k != "d2t"}, {}, "'d2t' is missing"),
        (ok, {"vocab_size": 300}, "vocab_size 300: expected the model's 256"),
        (ok, {"architectures": ["LlamaForCausalLMEagle"]}, "architectures.*LlamaForCausalLMEagle3"),
        (ok, {"num_hidden_layers": 2}, "num_hidden_layers 2: expected 1"),
        (ok, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}}, r"\[0, 1, 4\]: expected three distinct"),
        (ok, {"eagle_config": {}}, r"default layers .* = \[1, 1, 0\]"),  # (4 layers: too few for the default)
    ]
    for i, (tensors, conf, match) in enumerate(cases):
        with pytest.raises(ConfigError, match=match) as err:
            read_head(write_head(tmp_path / str(i), tensors, conf), cfg)
        assert err.value.key == "speculative_draft_model_path" and str(tmp_path / str(i)) in str(err.value)
    assert default_layers(32) == (1, 15, 28)  # SGLang's capture before layers 2, L/2, L - 3


async def test_engine_refusals(models, tmp_path):
    """Through the engine: no head path; a head whose d2t and t2d disagree (checked when the
    head loads); tensor parallel (a shard's stream is a partial sum)."""
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*EAGLE-3 head"):
        engine(models["random"], speculative_algorithm="eagle3")
    bad = head_tensors(1, draft_ids=torch.arange(64))
    bad["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.arange(1, 65), True)
    with pytest.raises(ConfigError, match="'t2d' marks other target ids"):
        engine(models["random"], write_head(tmp_path / "t2d", bad))
    with pytest.raises(ConfigError, match="tp_size.*eagle3"):
        engine(models["random"], models["head"], tp_size=2)


async def test_random_head_drafts_its_vocabulary(models):
    """A random head with a draft vocabulary of 64 of the 256 ids: every draft is one of
    those target ids (d2t), and output equals plain decoding's."""
    vocab = set(json.loads((models["head"] / "vocab.json").read_text()))
    eng = engine(models["random"], models["head"], speculative_eagle_topk=3)
    d = eng.scheduler.speculator.drafter
    drafted: list[int] = []
    orig = d.propose
    d.propose = lambda reqs, ks: [drafted.extend(o) or o for o in orig(reqs, ks)]
    calls = [([5, 9, 200, 31, 7] * 3, {"max_new_tokens": 10}), ([4, 4, 8, 15, 16, 23, 42], {"max_new_tokens": 10})]
    try:
        spec = await run_calls(eng, calls)
    finally:
        await eng.stop()
    plain_eng = engine(models["random"])
    try:
        plain = await run_calls(plain_eng, calls)
    finally:
        await plain_eng.stop()
    same_outputs(plain, spec)
    assert len(drafted) > 10 and set(drafted) <= vocab and len(set(drafted)) > 3


def test_launch_flag():
    """SGLang's ``--speculative-algorithm EAGLE3`` with the head's path; EAGLE and NEXTN
    stay refused by name."""
    def flags(*argv):
        return launch_flags.overrides(build_parser().parse_args(list(argv)))

    assert flags("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/heads/llama3-8b",
                 "--speculative-eagle-topk", "2") == {
        "speculative.algorithm": "eagle3", "speculative.draft_model_path": "/heads/llama3-8b",
        "speculative.eagle_topk": 2}
    for name in ("EAGLE", "NEXTN"):
        with pytest.raises(ConfigError, match=f"--speculative-algorithm.*{name}"):
            flags("--speculative-algorithm", name)
    # SGLang's EAGLE depth and node count: steps 3, topk 1, 4 tokens (the root and 3 drafts)
    sglang = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk")
    assert flags(*sglang, "1", "--speculative-num-draft-tokens", "4")["speculative.num_draft_tokens"] == 3
    assert flags(*sglang, "4", "--speculative-num-draft-tokens", "13")["speculative.num_draft_tokens"] == 3
    assert flags("--speculative-num-steps", "5") == {"speculative.num_draft_tokens": 5}
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens.*13 with --speculative-num-steps 3"):
        flags(*sglang, "4", "--speculative-num-draft-tokens", "16")  # (a budget below the tree: not pruned here)
