"""GGUF weights served as shipped (``model.gguf_weights = "native"``): Q4_1 / Q8_0 read
straight into the int4 / int8 layouts, the CPU kernels against the dequantized weights, and a
tiny random GGUF (written here by the ``gguf`` package) generating as transformers does on the
same file."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest
import torch

from radixd import Engine, SamplingParams
from radixd.core import cpu_kernels, cpu_setup
from radixd.core import gguf as native
from radixd.core.errors import ConfigError
from radixd.core.quant.formats import IntLayout
from radixd.core.quant.linear import QuantLinear
from radixd.core.quant.ops import dequantize_int, quantize_int

H, FF, L, NH, KV, V = 64, 128, 2, 4, 2, 256
PROMPT = [1, 17, 93, 200, 45, 8, 150]
# bf16 activations and bf16 outputs in the int kernels: about 2**-8 of a result's scale
BF16 = 2.0**-7
# int8 activations per block of 32 (RADIXD_CPU_ACT_BITS=8, as llama.cpp): about 1/254 of a block's
# largest value; two int8 planes (as shipped): about 1/254 of that
Q8 = 2.0**-5
Q16 = 2.0**-10
# float32 activations and the dequantized weight in float32 (AVX2's FMA kernel): the records'
# fp16 scales (a GGUF's own are fp16; quantize_int's float32 ones round to fp16, 2**-11)
FP16_SCALES = 2.0**-10
TOLERANCE = {"native": Q16, "native8": Q8, "avx2": FP16_SCALES, "baseline": BF16}


@pytest.fixture(params=["native", "native8", "avx2", "baseline"])
def isa(request, monkeypatch):
    """The CPU's integer kernels where it has AVX512-VNNI, on activations in two int8 planes
    ("native", as shipped) or one ("native8": RADIXD_CPU_ACT_BITS=8, llama.cpp's Q8; on a CPU
    with AVX2 only, its integer kernel on that plane); "avx2", the FMA kernel a CPU with AVX2
    but no AVX512 runs (its "native" there: yielded as "avx2"); "baseline", torch's int
    kernels (bf16 activations) as on a CPU with neither."""
    name = request.param
    if name == "native" and not cpu_kernels.vnni():
        if not cpu_kernels.avx2():
            pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
        name = "avx2"  # (what this CPU runs as shipped)
    elif name == "native8" and not cpu_kernels.vnni() and not cpu_kernels.avx2():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    elif name == "avx2":
        if not cpu_kernels.vnni():
            pytest.skip("this CPU runs the AVX2 kernel as shipped (the native case)")
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    if name == "baseline":
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "baseline")
    if name == "native8":
        monkeypatch.setenv(cpu_kernels.ACT_ENV, "8")
    cpu_kernels.reset()
    if name == "avx2" and not cpu_kernels.avx2():
        pytest.skip("this CPU has no AVX2 / FMA / F16C")
    yield name
    monkeypatch.undo()
    cpu_kernels.reset()


def write_tiny_gguf(path, seed: int = 0, untied: bool = False):
    """A llama GGUF; ``untied``: an ``output.weight`` and a Q4_1 embedding table, F16 norms."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(H // NH)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(0x100 + i) for i in range(3, V)])
    w.add_token_types([1] * V)
    w.add_token_scores([0.0] * V)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, shape, kind, scale):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == "blk.1.ffn_up.weight":
            a[:4, :32] = 0.25  # constant blocks: Q4_1's d = 0
        w.add_tensor(name, quantize(a, kind), raw_dtype=kind)

    norm = np.float16 if untied else np.float32
    if untied:
        add("token_embd.weight", (V, H), T.Q4_1, 1.0)
        add("output.weight", (V, H), T.Q4_1, 1.0)
    else:
        add("token_embd.weight", (V, H), T.Q8_0, 1.0)  # tied: the LM head too, as in the default model
    w.add_tensor("output_norm.weight", np.ones(H, norm))
    kv = KV * H // NH
    for layer in range(L):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(norm))
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(norm))
        for name, shape in (("attn_q", (H, H)), ("attn_k", (kv, H)), ("attn_v", (kv, H)), ("attn_output", (H, H)),
                            ("ffn_gate", (FF, H)), ("ffn_up", (FF, H)), ("ffn_down", (H, FF))):
            add(f"blk.{layer}.{name}.weight", shape, T.Q8_0 if name == "attn_output" else T.Q4_1, 0.3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_header_and_canonical_layout_are_the_files(tiny_gguf):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    meta, tensors = native.read(tiny_gguf)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == L
    theirs = GGUFReader(str(tiny_gguf)).tensors
    assert [(t.name, t.kind) for t in tensors] == [(t.name, t.tensor_type.name) for t in theirs]
    for t, ref in zip(tensors, theirs, strict=True):
        assert np.array_equal(t.data, ref.data), t.name
        if t.kind not in native.LAYOUTS:
            continue
        c = native.canonical(t)
        lay = native.LAYOUTS[t.kind]
        got = dequantize_int(c["weight"], c["weight_scale"], c.get("weight_zeros"), lay.bits, 32)
        want = torch.from_numpy(dequantize(ref.data, ref.tensor_type))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=t.name)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True)])
@pytest.mark.parametrize("rows", [1, 8])
def test_cpu_kernels_match_the_dequantized_weight(bits, symmetric, rows, isa):
    torch.manual_seed(0)
    n, k = 96, 160
    w = torch.randn(n, k)
    qw, s, z = quantize_int(w, bits, 32, symmetric)
    layer = QuantLinear(k, n, IntLayout(bits, 32, symmetric), bias=True, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(qw)
        layer.weight_scale.copy_(s)
        if z is not None:
            layer.weight_zeros.copy_(z)
        layer.bias.normal_()
    x = torch.randn(rows, k).bfloat16().float()  # (the kernels' activations are bf16)
    want = torch.nn.functional.linear(x, dequantize_int(qw, s, z, bits, 32), layer.bias)
    assert layer.pack_for_cpu() and not hasattr(layer, "weight")
    got = layer(x)
    assert got.dtype == torch.float32
    assert layer.cpu.kind == ("torch" if isa == "baseline" else "records")
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[isa] * want.abs().max().item())


def test_gguf_weights_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert native.choose("auto", cpu, 1) == "native"
    assert native.choose("auto", cuda, 1) == "fp32"
    assert native.choose("auto", cpu, 2) == "fp32"
    assert native.choose("fp32", cpu, 1) == "fp32"
    with pytest.raises(ConfigError, match="gguf_weights"):
        native.choose("native", cuda, 1)


async def _greedy(model: str, cache_dir: str | None, mode: str, prompt: list[int] | str = PROMPT,
                  n: int = 10, **engine) -> tuple[list[int], list[float]]:
    """Greedy tokens and the prompt's logprobs; a str ``prompt`` is a user message."""
    eng = Engine(model=model, cache_dir=cache_dir, gguf_weights=mode, kv_cache_tokens=256, **engine)
    try:
        toks, prompt_lp = [], None
        ids = eng.apply_chat_template([{"role": "user", "content": prompt}]) if isinstance(prompt, str) else prompt
        params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0, prompt_logprobs_from=1)
        async for out in eng.generate(input_ids=ids, params=params):
            toks += out.token_ids
            prompt_lp = out.prompt_logprobs or prompt_lp
        return toks, prompt_lp
    finally:
        await eng.stop()


def _hf_greedy(path, n: int) -> list[int]:
    """transformers' greedy tokens on the file (which it dequantizes to fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)[0, len(PROMPT):].tolist()


def test_tiny_gguf_native_matches_fp32_and_transformers(tiny_gguf, tmp_path, isa):
    got, got_lp = asyncio.run(_greedy(str(tiny_gguf), str(tmp_path), "native"))
    ref, ref_lp = asyncio.run(_greedy(str(tiny_gguf), str(tmp_path), "fp32"))
    assert (tmp_path / "models").is_dir() and any(p.name.endswith("-gguf") for p in (tmp_path / "models").iterdir())
    # the kernels' bf16 activations: about 2**-8 of each layer's output; the logits here are ~40;
    # one int8 plane (llama.cpp's Q8) about twice that; two planes far less
    rtol = {"native": 2e-3, "native8": 4e-2, "avx2": 1e-4, "baseline": 2e-2}[isa]
    np.testing.assert_allclose(got_lp, ref_lp, rtol=rtol, atol=0.05 if isa in ("native8", "baseline") else 5e-3)
    want = _hf_greedy(tiny_gguf, len(got))
    assert ref == want
    assert got == want


def test_tiny_gguf_native_prompt_over_several_chunks(tiny_gguf, tmp_path, isa):
    """A prompt longer than the prefill chunk: the chunks before its last compute no logits (a
    zero-row LM head, which the int kernels must take), and the tokens equal one chunk's."""

    async def greedy(**engine) -> list[int]:
        # (prefill_weights "dequantize": 21 rows or chunks of 8 all take the int kernel, whose
        # rows are independent; the bf16 copies would round the whole prompt differently)
        eng = Engine(model=str(tiny_gguf), cache_dir=str(tmp_path), gguf_weights="native", kv_cache_tokens=256,
                     prefill_weights="dequantize", **engine)
        try:
            params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0)
            return [t async for out in eng.generate(input_ids=PROMPT * 3, params=params) for t in out.token_ids]
        finally:
            await eng.stop()

    chunked = asyncio.run(greedy(chunked_prefill_size=8))
    assert len(chunked) == 6
    assert chunked == asyncio.run(greedy())


def _dequantized_in_a_step(*args, **kwargs):
    raise AssertionError("a step dequantized an int4 weight that has its bf16 copy")


def test_prefill_weight_copies_change_nothing_but_memory(tiny_gguf, tmp_path, isa, monkeypatch):
    """``prefill_weights``: "bf16" keeps each int4 weight's bf16 copy for prefill's GEMMs (a
    prompt of more rows than the kernels take), "dequantize" makes it every step: the same
    values, so the same logprobs bit for bit; "auto" keeps them while they are small."""
    from radixd.core.quant import cpu_int

    monkeypatch.setattr(cpu_setup, "native_bf16", lambda: True)  # (copies on any CPU; AVX2 takes none)
    prompt = PROMPT * 11  # 77 rows: a prefill GEMM on the dequantized weights

    async def run(mode: str):
        eng = Engine(model=str(tiny_gguf), cache_dir=str(tmp_path), gguf_weights="native", kv_cache_tokens=256,
                     prefill_weights=mode)
        try:
            heads = [m.cpu for m in eng.worker.model.modules() if isinstance(m, QuantLinear) and m.cpu is not None]
            params = SamplingParams(max_new_tokens=4, min_new_tokens=4, temperature=0, prompt_logprobs_from=1)
            toks, lp = [], None
            with monkeypatch.context() as m:
                if mode == "bf16":  # the steps read the copies: nothing is dequantized
                    for name in ("qdequant_bf16", "int4pack_to_bf16"):
                        m.setattr(cpu_kernels, name, _dequantized_in_a_step)
                async for out in eng.generate(input_ids=prompt, params=params):
                    toks += out.token_ids
                    lp = out.prompt_logprobs or lp
            return heads, toks, lp
        finally:
            await eng.stop()

    kept, toks, lp = asyncio.run(run("bf16"))
    made, toks2, lp2 = asyncio.run(run("dequantize"))
    if isa == "avx2" or (isa == "native8" and not cpu_kernels.vnni()):
        # the AVX2 kernels (float or int8 products) take every row count: no copies, whatever the option
        assert all(w.dense is None and not w.dense_bytes for w in kept + made)
        assert toks == toks2 and lp == lp2
        return
    int4 = [w for w in kept if w.bits == 4 and w.dense_bytes]
    assert int4 and all(w.dense is not None for w in int4)
    assert all(w.dense is None for w in made)
    for w in int4:
        torch.testing.assert_close(w.dense, w.dequantized(), atol=0, rtol=0)
    assert toks == toks2 and lp == lp2
    auto, _, _ = asyncio.run(run("auto"))  # (a few kB of copies)
    assert all(w.dense is not None for w in auto if w.bits == 4 and w.dense_bytes)
    assert cpu_int.prefill_copy_wanted("auto", 100 << 20) and not cpu_int.prefill_copy_wanted("auto", 2 << 30)
    assert cpu_int.prefill_copy_wanted("bf16", 2 << 30) and not cpu_int.prefill_copy_wanted("dequantize", 1)
    monkeypatch.setattr(cpu_int.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1 << 15)
    assert not cpu_int.prefill_copy_wanted("auto", 100 << 20)  # over an eighth of 128 MiB


def test_prefill_weights_option_names_its_choices():
    with pytest.raises(ConfigError, match="prefill_weights"):
        Engine(model="default", prefill_weights="fp16")


@pytest.mark.slow
def test_default_model_native_greedy_equals_fp32():
    # (the model's own GGUF, tests/test_default_model.py's; a few tokens: seconds)
    got, _ = asyncio.run(_greedy("default", None, "native", "What is the capital of France?", n=8))
    want, _ = asyncio.run(_greedy("default", None, "fp32", "What is the capital of France?", n=8))
    assert got == want


@pytest.mark.slow
def test_default_model_bf16_decode_steps_in_one_call_equal_the_layer_loop(monkeypatch):
    """The default model served as the daemon serves it on this CPU (bf16, native weights):
    decode steps through ``cpu_decode`` (one C call for all layers) give the layer loop's
    tokens and log-probabilities exactly, and the answer is still right."""
    from radixd.core import cpu_decode

    if not (cpu_kernels.vnni() and cpu_kernels.bf16dp()):
        pytest.skip("this CPU has no AVX512-VNNI / AVX512-BF16: no fused decode step")
    calls = []
    run = cpu_decode._run
    monkeypatch.setattr(cpu_decode, "_run", lambda *a: calls.append(1) or run(*a))
    question = "What is the capital of France? Answer in one word."

    async def decode(mode: str):
        monkeypatch.setenv(cpu_decode.ENV, mode)
        eng = Engine(model="default", gguf_weights="native", dtype="bfloat16", kv_cache_tokens=256)
        try:
            ids = eng.apply_chat_template([{"role": "user", "content": question}])
            toks, lps, text = [], [], ""
            params = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0, logprobs=True)
            async for out in eng.generate(input_ids=ids, params=params):
                toks += out.token_ids
                lps += [lp.logprob for lp in out.logprobs or []]
                text += out.text
            return toks, lps, text
        finally:
            await eng.stop()

    on = asyncio.run(decode("on"))
    n = len(calls)
    off = asyncio.run(decode("off"))
    assert n >= 11 and len(calls) == n  # every decode step of the first run, none of the second
    assert on == off and len(on[1]) == 12  # tokens, log-probabilities (bit for bit), text
    assert "Paris" in on[2]


def test_untied_q4_1_head_and_embedding_generate_as_transformers(tmp_path):
    path = write_tiny_gguf(tmp_path / "untied.gguf", seed=1, untied=True)
    got, _ = asyncio.run(_greedy(str(path), str(tmp_path), "native", n=6))
    assert got == _hf_greedy(path, len(got))


def test_unserved_ggml_type_is_refused_by_name(tmp_path):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    w.add_tensor("token_embd.weight", quantize(np.zeros((16, 64), np.float32), T.Q5_0), raw_dtype=T.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'token_embd.weight' is ggml type Q5_0.*gguf_weights = \"fp32\""):
        native.prepare(tmp_path / "q5.gguf", tmp_path / "out")


@pytest.mark.slow
def test_gguf_native_benchmark_quick(tmp_path):
    from benchmarks import gguf_native

    out = tmp_path / "gguf.json"
    doc = gguf_native.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    held = doc["weight_bytes"]
    assert held["native"] * 4 < held["fp32"]  # Q4_1 layers and a Q8_0 embedding against fp32
    assert all(doc["decode_tok_s"][m]["1"] > 0 for m in ("native", "fp32"))


@pytest.mark.parametrize("mode", ["fp32", "native"])
def test_threads_converting_one_gguf_into_a_fresh_cache_build_it_once(tmp_path, caplog, mode):
    """Several threads (one daemon's replicas, or a test suite's engines) resolve the same GGUF
    at once into an empty cache: each gets the same whole checkpoint, built by one of them."""
    import logging
    import threading

    from safetensors.torch import load_file

    from radixd.core.model_loader import read_config, resolve_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=2)
    cache = tmp_path / "cache"
    n = 6
    start = threading.Barrier(n)
    got: list[object] = [None] * n

    def resolve(i: int) -> None:
        start.wait()
        try:
            got[i] = resolve_model(str(path), str(cache), progress=False, gguf_weights=mode)
        except BaseException as e:  # (asserted below: every thread returned a path)
            got[i] = e

    with caplog.at_level(logging.INFO, logger="radixd.core.model_loader"):
        threads = [threading.Thread(target=resolve, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(not isinstance(g, BaseException) for g in got), got
    assert len(set(got)) == 1, got
    target = got[0]
    # one entry in the cache, no staging directories left beside it (the lock file may stay)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == [target.name]
    assert read_config(target).num_layers == L
    if mode == "fp32":
        assert [r.getMessage() for r in caplog.records].count(f"converting {path} into {target}") == 1
        state = load_file(str(target / "model.safetensors"))
        assert state["model.layers.1.mlp.up_proj.weight"].shape == (FF, H)
    else:
        assert native.source(target) == path.resolve()
    # and the entry serves: the same greedy tokens as transformers on the file
    tokens, _ = asyncio.run(_greedy(str(path), str(cache), mode, n=4))
    assert tokens == _hf_greedy(path, len(tokens))


def test_a_failed_or_killed_build_leaves_no_entry_and_is_redone(tmp_path):
    from radixd.core.cache_dir import build_once, is_checkpoint

    target = tmp_path / "models" / "m"

    def fails(staging):
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(target, fails, is_checkpoint)
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.lock"]
    target.mkdir()  # a builder killed mid-way in an older layout: a directory without config.json
    (target / "model.safetensors").write_bytes(b"partial")

    def builds(staging):
        staging.mkdir()
        (staging / "config.json").write_text('{"ok": true}')

    assert build_once(target, builds, is_checkpoint) == target
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert build_once(target, fails, is_checkpoint) == target  # done: not rebuilt



def test_one_int8_plane_without_int_kernels_says_it_has_no_effect(monkeypatch, caplog):
    """RADIXD_CPU_ACT_BITS=8 where no int kernel runs (RADIXD_CPU_ISA=baseline: torch's int
    kernels on bf16 activations) is named in a warning when the weights are packed, not
    ignored; where the int kernels run, nothing is said."""
    from radixd.core.quant.linear import pack_cpu_projections

    def packed_model():
        qw, s, z = quantize_int(torch.randn(48, 64), 4, 32, False)
        layer = QuantLinear(64, 48, IntLayout(4, 32, False), bias=False, dtype=torch.float32, device=torch.device("cpu"))
        with torch.no_grad():
            layer.weight.copy_(qw)
            layer.weight_scale.copy_(s)
            layer.weight_zeros.copy_(z)
        return torch.nn.Sequential(layer)

    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    monkeypatch.setenv(cpu_kernels.ACT_ENV, "8")
    cpu_kernels.reset()
    try:
        int_kernels = cpu_kernels.records()  # (as shipped on this CPU)
        with caplog.at_level(logging.WARNING, logger="radixd.core.quant.linear"):
            assert pack_cpu_projections(packed_model()) == 1
        assert ("has no effect" in caplog.text) == (not int_kernels)
        caplog.clear()
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "baseline")
        cpu_kernels.reset()
        with caplog.at_level(logging.WARNING, logger="radixd.core.quant.linear"):
            assert pack_cpu_projections(packed_model()) == 1
        assert "RADIXD_CPU_ACT_BITS=8 has no effect" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()
