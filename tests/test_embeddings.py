"""Embeddings: a tiny random Qwen3 made an embedding checkpoint here (sentence-transformers'
modules.json and 1_Pooling/config.json beside its weights) embeds as transformers' forward
(fp32, CPU) pooled the same way, alone, batched, chunked and over a cached prefix; the KV
accounting holds; the OpenAI client's ``embeddings.create`` works against a daemon; a
generation model refuses embeddings and an embedding model refuses generation."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import struct

import httpx
import pytest
import torch
from conftest import Daemon

from radixd import Engine
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError, ContextLengthExceeded, InvalidRequest
from radixd.core.pooling import Pooling, engine_pooling, read_pooling

TOL = 2e-5  # fp32 against fp32
ST = "sentence_transformers.models."


def embedding_checkpoint(src, dst, mode: str, normalize: bool = True, extra: list | None = None):
    """``src`` (a tiny checkpoint) copied to ``dst`` with sentence-transformers files."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules + (extra or [])))
    (dst / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    return dst


@pytest.fixture(scope="module")
def ckpts(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    src = tiny_models["qwen3"]
    return {"lasttoken": embedding_checkpoint(src, root / "last", "lasttoken"),
            "mean_tokens": embedding_checkpoint(src, root / "mean", "mean_tokens", normalize=False),
            "cls_token": embedding_checkpoint(src, root / "cls", "cls_token")}


_HF: dict = {}


def oracle(path, ids: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states (after the last norm), pooled the same way."""
    from transformers import AutoModel

    if path not in _HF:
        _HF[path] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = _HF[path](torch.tensor([ids])).last_hidden_state[0]
    v = {"lasttoken": h[-1], "mean_tokens": h.mean(0), "cls_token": h[0]}[mode]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def make_engine(path, **kw) -> Engine:
    eng = Engine(model=str(path), kv_cache_tokens=kw.pop("kv_cache_tokens", 2048), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


async def embed(eng: Engine, ids: list[int]):
    outs = [o async for o in eng.embed(input_ids=ids)]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "stop" and not outs[0].token_ids
    return outs[0]


def assert_idle(eng: Engine):
    acc = eng.scheduler.accounting()
    assert acc["private"] == 0 and acc["locked"] == 0
    assert acc["free"] + acc["evictable"] == acc["total"]
    eng.check_accounting()


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (length + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens", "cls_token"])
async def test_embeddings_match_transformers_batched_and_chunked(ckpts, mode):
    path = ckpts[mode]
    normalize = mode != "mean_tokens"
    # a chunk of 8 tokens: the longer prompts are pooled over several steps
    eng = make_engine(path, chunked_prefill_size=8, max_prefill_tokens=24)
    widest = []
    eng.step_hook = lambda step: (eng.check_accounting(), widest.append(len(step.pool_reqs)))
    assert eng.pooling == Pooling({"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}[mode], normalize)
    ps = prompts(5, 3)
    try:
        one = await embed(eng, ps[0])
        together = await asyncio.gather(*(embed(eng, p) for p in ps))  # batched in the same steps
        for p, out in zip(ps, together, strict=True):
            want = oracle(path, p, mode, normalize)
            assert (torch.tensor(out.embedding) - want).abs().max() < TOL
            assert out.prompt_tokens == len(p)
        assert one.embedding == pytest.approx(together[0].embedding, abs=TOL)
        assert max(widest) >= 3  # several embeddings in one step
        if normalize:
            assert torch.tensor(one.embedding).norm() == pytest.approx(1.0, abs=1e-5)
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_tensor_parallel_embeddings(ckpts):
    path = ckpts["lasttoken"]
    eng = make_engine(path, tp_size=2)
    try:
        ps = prompts(3, 6, seed=9)
        outs = await asyncio.gather(*(embed(eng, p) for p in ps))
        for p, out in zip(ps, outs, strict=True):
            assert (torch.tensor(out.embedding) - oracle(path, p, "lasttoken", True)).abs().max() < TOL
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_cached_prefix_is_shared_where_the_pooling_allows(ckpts):
    shared = prompts(1, 40, seed=3)[0]
    a, b = shared + [7, 8, 9], shared + [11, 12]
    for mode, reuses in (("lasttoken", True), ("mean_tokens", False)):
        path, normalize = ckpts[mode], mode == "lasttoken"
        eng = make_engine(path)
        try:
            first = await embed(eng, a)
            second = await embed(eng, b)  # its prefix is in the radix cache now
            again = await embed(eng, a)
            assert first.cached_tokens == 0
            if reuses:  # last-token pooling needs only the last position's hidden state
                assert second.cached_tokens >= len(shared) and again.cached_tokens == len(a) - 1
            else:  # mean pooling needs every position's: the prompt is computed again
                assert second.cached_tokens == 0 and again.cached_tokens == 0
            assert (torch.tensor(second.embedding) - oracle(path, b, mode, normalize)).abs().max() < TOL
            assert again.embedding == pytest.approx(first.embedding, abs=TOL)
            assert eng.stats()["kv"]["evictable"] >= len(a)  # the prompts' KV went into the cache
            assert_idle(eng)
        finally:
            await eng.stop()


async def test_embedding_calls_leave_no_kv_behind(ckpts):
    """Finished embeddings sharing a pool smaller than the batch, and an aborted one: every
    slot accounted for after every step and at the end."""
    path = ckpts["mean_tokens"]
    eng = make_engine(path, kv_cache_tokens=96, chunked_prefill_size=16)
    ps = prompts(6, 20, seed=5)
    try:
        outs = await asyncio.gather(*(embed(eng, p) for p in ps))
        for p, out in zip(ps, outs, strict=True):
            assert (torch.tensor(out.embedding) - oracle(path, p, "mean_tokens", False)).abs().max() < TOL
        sub = eng.embed(input_ids=ps[-1])
        sub.close()  # left before its output: aborted
        for _ in range(50):
            await asyncio.sleep(0.01)
            if not eng.num_inflight and not eng.num_running and not eng.num_waiting:
                break
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_embedding_limits_and_refusals(ckpts, tiny_models):
    eng = make_engine(ckpts["lasttoken"], max_context_len=32)
    gen = make_engine(tiny_models["llama"])
    try:
        assert len((await embed(eng, list(range(2, 34)))).embedding) == 64  # the whole context
        with pytest.raises(ContextLengthExceeded, match="maximum context length is 32 tokens") as exc:
            eng.embed(input_ids=list(range(2, 35)))
        assert exc.value.field == "prompt"
        with pytest.raises(InvalidRequest, match="the prompt is empty"):
            eng.embed(input_ids=[])
        with pytest.raises(InvalidRequest, match="embedding model") as exc:  # as vLLM and SGLang refuse it
            eng.submit(input_ids=[3, 4], params={"max_new_tokens": 2})
        assert exc.value.field == "model"
        with pytest.raises(InvalidRequest, match="no embeddings") as exc:
            gen.embed(input_ids=[3, 4])
        assert exc.value.field == "model"
        assert_idle(eng)
    finally:
        await eng.stop()
        await gen.stop()


def test_checkpoint_pooling_and_task(ckpts, tiny_models, tmp_path):
    assert read_pooling(ckpts["lasttoken"]) == Pooling("last", True)
    assert read_pooling(ckpts["cls_token"]) == Pooling("cls", True)
    assert read_pooling(tiny_models["qwen3"]) is None
    assert engine_pooling("auto", tiny_models["qwen3"]) is None
    assert engine_pooling("embed", tiny_models["qwen3"]) == Pooling("last", True)  # vLLM's default
    assert engine_pooling("generate", ckpts["lasttoken"]) is None
    dense = embedding_checkpoint(tiny_models["qwen3"], tmp_path / "dense", "mean_tokens",
                                 extra=[{"idx": 3, "name": "3", "path": "3_Dense", "type": ST + "Dense"}])
    with pytest.raises(ConfigError, match="Dense"):
        read_pooling(dense)
    weighted = embedding_checkpoint(tiny_models["qwen3"], tmp_path / "weighted", "max_tokens")
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        read_pooling(weighted)
    with pytest.raises(ConfigError, match="task"):
        EngineConfig(task="classify")


def test_check_config_refuses_a_bad_task(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[model]\ntask = "rerank"\n')
    done = subprocess.run([sys.executable, "-m", "radixd", "check-config", str(cfg)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "model.task" in done.stdout + done.stderr and "'embed'" in done.stdout + done.stderr


TOML = """
[model]
path = "{model}"
served_name = "{name}"
[server]
port = 0
[memory]
kv_cache_tokens = 2048
"""


@pytest.fixture(scope="module")
def daemon(ckpts, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("embed-daemon"), TOML.format(model=ckpts["lasttoken"], name="tiny-embed"))
    yield d
    assert d.stop() == 0


def test_openai_client_embeddings(daemon, ckpts):
    from openai import BadRequestError, OpenAI

    from radixd.core.assembly import load_tokenizer

    path = ckpts["lasttoken"]
    tok = load_tokenizer(path)
    client = OpenAI(base_url=daemon.url + "/v1", api_key="none")
    texts = ["hello world", "The capital of France is Paris.", "hello world, hello radix attention"]
    # the official client asks for base64 and decodes it (little-endian float32)
    res = client.embeddings.create(model="tiny-embed", input=texts)
    assert res.object == "list" and res.model == "tiny-embed" and [d.index for d in res.data] == [0, 1, 2]
    ids = [tok(t).input_ids for t in texts]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for d, p in zip(res.data, ids, strict=True):
        assert d.object == "embedding"
        assert (torch.tensor(d.embedding) - oracle(path, p, "lasttoken", True)).abs().max() < TOL
    # floats over plain HTTP are the same numbers, and base64 decodes to them exactly
    floats = httpx.post(daemon.url + "/v1/embeddings", json={"input": texts[1], "encoding_format": "float"}).json()
    b64 = httpx.post(daemon.url + "/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats["data"][0]["embedding"]
    assert floats["data"][0]["embedding"] == pytest.approx(res.data[1].embedding, abs=TOL)
    # token ids, one list or several
    one = client.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="tiny-embed", input=ids[:2], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(res.data[0].embedding, abs=TOL)
    for got, want in zip(many.data, res.data[:2], strict=True):
        assert got.embedding == pytest.approx(want.embedding, abs=TOL)
    # Matryoshka: the first N values, normalised again
    short = client.embeddings.create(model="tiny-embed", input=texts[0], dimensions=16, user="u1")
    want = torch.nn.functional.normalize(torch.tensor(res.data[0].embedding[:16]), dim=-1)
    assert len(short.data[0].embedding) == 16
    assert (torch.tensor(short.data[0].embedding) - want).abs().max() < TOL

    def refused(status: int, param: str | None, **body) -> dict:
        r = httpx.post(daemon.url + "/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        return r.json()["error"]

    assert "64" in refused(400, "dimensions", input="a", dimensions=65)["message"]
    refused(400, "dimensions", input="a", dimensions=0)
    assert "empty string" in refused(400, "input", input="")["message"]
    assert "'input[1]'" in refused(400, "input", input=["a", ""])["message"]
    refused(400, "input", input=[])
    refused(400, "input", input=[[]])
    refused(400, "encoding_format", input="a", encoding_format="bytes")
    refused(400, "stream", input="a", stream=True)  # unknown fields are refused, not ignored
    refused(404, "model", input="a", model="other")
    err = refused(400, "input", input=list(range(2, 200)) * 3)  # 594 tokens; the context is 512
    assert err["code"] == "context_length_exceeded" and "maximum context length is 512" in err["message"]
    with pytest.raises(BadRequestError, match="embedding model"):  # no generation from an embedding model
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(daemon.url + "/health", timeout=30).status_code == 200
    info = httpx.get(daemon.url + "/get_model_info").json()
    assert info["is_generation"] is False
    kv = httpx.get(daemon.url + "/server_info").json()["stats"]["kv"]
    assert kv["locked"] == 0 and kv["private"] == 0 and kv["evictable"] > 0


async def test_generation_model_refuses_embeddings(tiny_models):
    from radixd.plugins import make_plugin_manager
    from radixd.server.app import ServerState, build_app
    from radixd.settings import Settings

    pm = make_plugin_manager(load_entry_points=False)
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=1024, plugin_manager=pm)
    state = ServerState(engine=engine, settings=Settings(), model_name="tiny-llama", api_keys=[], plugins=pm)
    try:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/embeddings", json={"input": "hello", "model": "tiny-llama"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "'tiny-llama'" in err["message"] and "embeddings" in err["message"]
    finally:
        await engine.stop()


def test_scheduler_batches_embeddings_with_generation():
    """The scheduler alone (``test_scheduler``'s fake worker): embedding requests prefill in
    the same steps as generation requests decode, are chunked, pool each wanted position
    exactly once (also across a preemption), sample nothing, read a prefix a generation
    request cached (last-token pooling) and leave nothing behind."""
    from test_scheduler import FakeWorker, drain, free_of_requests, make, pick, prompt, req, step

    from radixd.core.pooling import PoolState

    class PoolingWorker(FakeWorker):
        def run(self, step, prev_picks=None):
            out = super().run(step, prev_picks)
            b = step.batch
            out.pooled = torch.zeros(b.pool_rows, 2)  # per pooled position: (its position, 1)
            for p, row in zip(b.pool_pos, b.pool_row, strict=True):
                out.pooled[row] += torch.tensor([float(b.positions[p]), 1.0])
            return out

    s, w = make(max_prefill_tokens=24, chunked_prefill_size=16), PoolingWorker()
    shared = prompt(30)
    g = req(s, shared + [99], rid="gen", max_new_tokens=6)
    drain(s, w)  # its prompt is cached now
    gen = [req(s, prompt(10, base), rid=f"g{base}", max_new_tokens=8) for base in (5, 40)]
    step_of = len(w.batches)
    mean = req(s, prompt(40, 7), rid="mean", max_new_tokens=0)
    mean.pool = PoolState(Pooling("mean", False), 40)
    last = req(s, shared + [98, 97], rid="last", max_new_tokens=0)
    last.pool = PoolState(Pooling("last", True), 32)
    drain(s, w)
    for r in gen + [g]:
        assert r.output_ids == [pick(r, i) for i in range(r.params.max_new_tokens)]
    mixed = [st for st in w.batches[step_of:] if st.pool_reqs and st.sampled]
    assert mixed, "no step both pooled and sampled"
    assert all(r.pool is None for st in w.batches for r in st.sampled)
    assert sum(n for st in w.batches for r, n, _ in st.pool_reqs if r is mean) == 40
    assert len([st for st in w.batches if any(r is mean for r, _, _ in st.pool_reqs)]) >= 3  # chunked
    assert mean.pool.total.tolist() == [float(sum(range(40))), 40.0] and mean.output_ids == []
    assert last.cached_tokens == 30 and last.pool.total.tolist() == [31.0, 1.0]
    assert mean.finish_reason == last.finish_reason == "stop"
    free_of_requests(s)

    # preempted mid-prompt (a decode needs its KV), it resumes without pooling a position twice
    s, w = make(slots=48, max_prefill_tokens=8, chunked_prefill_size=8), PoolingWorker()
    g = req(s, prompt(20), rid="gen", max_new_tokens=28)  # it needs the whole pool in the end
    while g.kv.length < 20:
        step(s, w)
    mean = req(s, prompt(26, 50), rid="mean", max_new_tokens=0)
    mean.pool = PoolState(Pooling("mean", False), 26)
    drain(s, w)
    assert mean.preemptions == 1 and g.output_ids == [pick(g, i) for i in range(28)]
    assert mean.pool.total.tolist() == [float(sum(range(26))), 26.0] and mean.finish_reason == "stop"
    free_of_requests(s)


async def test_headless_checkpoint(ckpts, tmp_path):
    """Saved as Qwen3-Embedding is (the bare model: no "model." prefix, no LM head): an
    embedding engine loads it; a generation engine still refuses the missing head."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "headless"
    shutil.copytree(ckpts["lasttoken"], path)
    weights = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              path / "model.safetensors", metadata={"format": "pt"})
    eng = make_engine(path)
    try:
        ids = prompts(1, 9, seed=7)[0]
        out = await embed(eng, ids)
        assert (torch.tensor(out.embedding) - oracle(ckpts["lasttoken"], ids, "lasttoken", True)).abs().max() < TOL
    finally:
        await eng.stop()
    with pytest.raises(KeyError, match="lm_head"):
        Engine(model=str(path), kv_cache_tokens=256, task="generate")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens"])
async def test_cuda_embeddings_match_transformers(ckpts, mode):
    """The CUDA path (bf16 weights, the Triton attention, pooled rows copied back with the
    picks) against transformers' fp32 pooled hidden states, within bf16 tolerance."""
    path = ckpts[mode]
    normalize = mode != "mean_tokens"
    eng = make_engine(path, device="cuda", dtype="bfloat16", chunked_prefill_size=8, max_prefill_tokens=24)
    try:
        ps = prompts(4, 6)
        outs = await asyncio.gather(*(embed(eng, p) for p in ps))
        for p, out in zip(ps, outs, strict=True):
            want = oracle(path, p, mode, normalize)
            got = torch.tensor(out.embedding)
            assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
            assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert_idle(eng)
    finally:
        await eng.stop()
