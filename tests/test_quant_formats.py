"""Quantized checkpoints (``radixd.core.quant.formats``): for each format, radixd's logits
match transformers' on the same checkpoint and greedy tokens are equal where the margin
allows, under chunked prefill, cache hits, preemption and tensor parallelism; bad
checkpoints fail at load naming the tensor and what was expected.

Checkpoints (made once per session): llmcompressor's ``oneshot`` (compressed-tensors) on tiny
random Llama and Qwen3 models; GPTQ / AWQ / block fp8 from ``quant_checkpoints``' writers.
References: transformers loading the quantized checkpoint itself (compressed-tensors
symmetric formats, block fp8, which it dequantizes on CPU); where its loader needs a backend
that does not install on CPU (GPTQ, AWQ: gptqmodel) or cannot read the checkpoint (asymmetric
pack-quantized: zero points packed along N), transformers on the weights dequantized by the
format's own reader (AutoAWQ's ``dequantize_gemm``, compressed-tensors' decompressor, GPTQ's
published formula).

Tolerances (fp32, CPU; logits of order 1-4): ``EXACT`` where the reference computes what radixd
does (weight-only int; FP8_DYNAMIC, whose per-token fp8 activations transformers fake-
quantizes too); ``LOOSE`` for block fp8, whose transformers reference leaves activations
unquantized while radixd quantizes them per token and block (as the checkpoint declares).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import _hf_model, make_tiny_checkpoint
from quant_checkpoints import (
    awq_checkpoint,
    decompressed_twin,
    dense_twin,
    fp8_block_checkpoint,
    gptq_checkpoint,
    last_logits,
    oneshot_checkpoint,
)
from safetensors.torch import load_file, save_file
from test_engine import assert_idle, collect, make_engine, prompts, tp1_and_tp2_tokens

from radixd import Engine
from radixd.core.errors import ConfigError
from radixd.core.quant.formats import QuantFormatError
from radixd.core.quant.linear import QuantLinear

pytest.importorskip("llmcompressor")

EXACT = 1e-3
LOOSE = 0.1  # x max |logit|
INT4_G32 = dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
FORMATS = {
    # name: (base, how it is made, reference kind, tolerance)
    "ct-fp8-dynamic": ("llama", "FP8_DYNAMIC", "self", EXACT),
    "ct-fp8-dynamic-qwen3": ("qwen3", "FP8_DYNAMIC", "self", EXACT),
    "ct-fp8-tensor": ("llama", dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                                    input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="token",
                                                           dynamic=True)), "self", EXACT),
    "ct-w4a16-g32": ("llama", INT4_G32, "self", EXACT),
    "ct-w4a16-g32-qwen3": ("qwen3", INT4_G32, "self", EXACT),
    "ct-w4-asym-g32": ("llama", dict(weights=dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                  group_size=32)), "decompressed", EXACT),
    "ct-w8-channel": ("llama", dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel")), "self",
                      EXACT),
    "ct-w8-asym-channel": ("qwen3", dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="channel")),
                           "decompressed", EXACT),
    "fp8-block": ("qwen3", "fp8-block", "self", LOOSE),
    "gptq": ("llama", dict(desc_act=False, sym=True), "dense", EXACT),
    "gptq-act-order": ("qwen3", dict(desc_act=True, sym=True), "dense", EXACT),
    "gptq-v2-asym": ("llama", dict(desc_act=False, sym=False, v2=True), "dense", EXACT),
    "gptq-int8": ("llama", dict(bits=8, desc_act=True, sym=False), "dense", EXACT),
    "awq": ("qwen3", "awq", "dense", EXACT),
}


@pytest.fixture(scope="session")
def quant_models(tmp_path_factory):
    """{format: (quantized checkpoint, reference checkpoint for transformers)}."""
    root = tmp_path_factory.mktemp("quant")
    bases = {a: make_tiny_checkpoint(root / a, a, seed=7) for a in ("llama", "qwen3")}
    out = {}
    for name, (arch, how, ref, _) in FORMATS.items():
        base, dst = bases[arch], root / name
        if name.startswith("ct-"):
            path = oneshot_checkpoint(base, dst, how)
            out[name] = (path, path if ref == "self" else decompressed_twin(path, base, root / f"{name}-dense"))
        elif name == "fp8-block":
            path = fp8_block_checkpoint(base, dst)
            out[name] = (path, path)
        elif name == "awq":
            path, dense = awq_checkpoint(base, dst)
            out[name] = (path, dense_twin(base, root / f"{name}-dense", dense))
        else:
            path, dense = gptq_checkpoint(base, dst, **how)
            out[name] = (path, dense_twin(base, root / f"{name}-dense", dense))
    out["bases"] = bases
    return out


def ref_greedy(ref, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    model = _hf_model(ref)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=1)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0]


def assert_tokens(ref, prompt, got: list[int], tol: float) -> None:
    """Equal to the reference's greedy tokens up to the first step whose reference margin
    between the two picks is within ``tol`` (there either pick is right; the rest diverges)."""
    want, logits = ref_greedy(ref, prompt, len(got))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            gap = float(logits[i, b] - logits[i, a])
            assert gap < tol, f"step {i}: radixd {a} vs reference {b}, margin {gap} > {tol}"
            return


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_logits_match_transformers(quant_models, fmt):
    path, ref = quant_models[fmt]
    tol = FORMATS[fmt][3]
    eng = make_engine(path)
    try:
        model = eng.worker.model
        assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
        assert isinstance(model.layers[1].mlp.down_proj, QuantLinear)
        assert not isinstance(model.lm_head, QuantLinear)  # (left unquantized by the checkpoint)
        p = prompts(1, 17, seed=10)[0]
        ours = last_logits(eng, p)
        with torch.no_grad():
            want = _hf_model(ref)(torch.tensor([p])).logits[0, -1]
            base = _hf_model(quant_models["bases"][FORMATS[fmt][0]])(torch.tensor([p])).logits[0, -1]
        atol = tol if tol == EXACT else tol * float(want.abs().max())
        torch.testing.assert_close(ours, want, rtol=0, atol=atol)
        assert float((want - base).abs().max()) > 10 * EXACT  # (the reference is quantized, not the base)
    finally:
        asyncio.run(eng.stop())


@pytest.mark.parametrize("fmt", ["ct-fp8-dynamic", "ct-w4a16-g32-qwen3", "gptq-act-order", "awq", "fp8-block"])
async def test_greedy_under_chunks_cache_hits_and_preemption(quant_models, fmt):
    """Small prefill chunks and a pool small enough to preempt, then a prompt extending an
    earlier one (its prefix from the cache): every output is the reference's greedy run."""
    path, ref = quant_models[fmt]
    tol = 2 * FORMATS[fmt][3] * (1 if FORMATS[fmt][3] == EXACT else 4)
    eng = make_engine(path, kv_cache_tokens=150, schedule_conservativeness=0.0, chunked_prefill_size=5,
                      max_prefill_tokens=8)
    try:
        base = prompts(1, 25, seed=3)[0]
        longer = base + await collect(eng, base, 6) + [7]
        got = await collect(eng, longer, 8)
        assert eng.stats()["cache_hit_tokens"] >= 25 + 5
        assert_tokens(ref, longer, got, tol)
        ps = prompts(4, 25, seed=5)
        outs = await asyncio.gather(*(collect(eng, p, 20) for p in ps))
        assert eng.scheduler.stats.preemptions > 0
        for p, got in zip(ps, outs, strict=True):
            assert_tokens(ref, p, got, tol)
        await assert_idle(eng)
    finally:
        await eng.stop()


@pytest.mark.parametrize("fmt", ["ct-w4a16-g32", "gptq-v2-asym", "fp8-block", "ct-fp8-dynamic-qwen3"])
async def test_tp2_gives_the_tp1_tokens(quant_models, fmt):
    """Quantized weights, scales and zeros split by rows (q/k/v, gate/up) and by whole
    groups or blocks of input columns (o_proj, down_proj): two shards give one model's
    tokens. Per-token fp8 activations are scaled per shard (each shard's columns of a row,
    as SGLang and vLLM do), so FP8_DYNAMIC under tp 2 is held to the reference's tokens
    where the margin allows instead."""
    path, ref = quant_models[fmt]
    ps = prompts(2, 20, seed=4)

    def check(shard):
        down = shard.layers[0].mlp.down_proj
        assert isinstance(down, QuantLinear) and down.in_features == 64

    runs = await tp1_and_tp2_tokens(path, ps, 8, check)
    if fmt == "ct-fp8-dynamic-qwen3":
        for p, got in zip(ps, runs[1], strict=True):
            assert_tokens(ref, p, got, 0.05)
    else:
        assert runs[0] == runs[1]


def test_tp_that_splits_a_group_is_refused(quant_models, tmp_path):
    """o_proj has 64 input columns in one group of 64: 2 shards of 32 would cut it."""
    path, _ = gptq_checkpoint(quant_models["bases"]["llama"], tmp_path / "g64", group=64)
    with pytest.raises(ConfigError, match=r"tp_size.*o_proj's groups of 64 input columns whole \(64 columns\)"):
        Engine(model=str(path), kv_cache_tokens=64, tp_size=2)


def test_act_order_with_tp_is_refused(quant_models):
    path, _ = quant_models["gptq-act-order"]
    with pytest.raises(ConfigError, match=r"tp_size.*act-order"):
        Engine(model=str(path), kv_cache_tokens=64, tp_size=2)


# ----------------------------------------------------------------------------- bad checkpoints


def _broken(quant_models, fmt, tmp_path, edit_tensors=None, edit_config=None):
    import shutil

    src, _ = quant_models[fmt]
    dst = tmp_path / f"broken-{fmt}"
    shutil.copytree(src, dst)
    if edit_tensors:
        state = load_file(dst / "model.safetensors")
        edit_tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _drop(key):
    return lambda s: s.pop(key)


def _set_cfg(path: list[str], value):
    def edit(qc):
        d = qc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


BAD = [
    ("ct-w4a16-g32", _drop("model.layers.1.mlp.up_proj.weight_scale"), None,
     QuantFormatError, r"'model\.layers\.1\.mlp\.up_proj\.weight_scale' is missing"),
    ("ct-fp8-dynamic", _drop("model.layers.0.self_attn.k_proj.weight_scale"), None,
     QuantFormatError, r"'model\.layers\.0\.self_attn\.k_proj\.weight' is fp8, but "
                       r"'model\.layers\.0\.self_attn\.k_proj\.weight_scale' is missing"),
    ("gptq", _drop("model.layers.0.mlp.down_proj.qzeros"), None,
     QuantFormatError, r"down_proj\.qzeros' is missing.*qweight, qzeros, scales"),
    ("fp8-block", _drop("model.layers.1.self_attn.o_proj.weight_scale_inv"), None,
     QuantFormatError, r"o_proj\.weight' is fp8, but '.*o_proj\.weight_scale_inv' is missing"),
    ("ct-w4a16-g32", None, _set_cfg(["config_groups", "group_0", "weights", "group_size"], 16),
     QuantFormatError, r"down_proj\.weight_scale': float32 \[64, 4\], expected .*\[64, 8\].*group of 16"),
    ("gptq", None, _set_cfg(["group_size"], 64),
     QuantFormatError, r"down_proj\.scales': float16 \[4, 64\], expected .*\[2, 64\].*group of 64"),
    ("awq", None, _set_cfg(["group_size"], 48),
     QuantFormatError, r"'model\.layers\.\d\.\w+\.\w+_proj': its \d+ input columns are not whole groups of "
                       r"group_size 48"),
    ("ct-w4a16-g32", lambda s: s.update({"model.layers.0.mlp.gate_proj.weight_packed":
                                          s["model.layers.0.mlp.gate_proj.weight_packed"][:, :4].contiguous()}), None,
     QuantFormatError, r"gate_proj\.weight_packed': int32 \[128, 4\], expected int32 \[128, 8\]"),
    ("ct-w4a16-g32", None, _set_cfg(["config_groups", "group_0", "weights", "num_bits"], 3),
     QuantFormatError, r"num_bits = 3 is not supported; radixd reads 4 or 8"),
    ("ct-fp8-dynamic", None, _set_cfg(["format"], "nvfp4-pack-quantized"),
     QuantFormatError, r"format = 'nvfp4-pack-quantized' is not supported"),
    ("gptq", None, _set_cfg(["quant_method"], "bitsandbytes"),
     QuantFormatError, r"quant_method 'bitsandbytes' is not supported; radixd reads compressed-tensors, fp8, gptq, awq"),
    ("awq", None, _set_cfg(["version"], "gemv"),
     QuantFormatError, r"version = 'gemv' is not supported; radixd reads 'gemm'"),
    ("gptq", None, _set_cfg(["checkpoint_format"], "marlin"),
     QuantFormatError, r"checkpoint_format = 'marlin' is not supported"),
    ("ct-fp8-dynamic", None, _set_cfg(["config_groups", "group_0", "input_activations"], None),
     QuantFormatError, r"input_activations = None is not supported.*weight-only fp8 is not implemented"),
    ("gptq-act-order", lambda s: s.update({"model.layers.0.self_attn.k_proj.g_idx":
                                            s["model.layers.0.self_attn.k_proj.g_idx"].flip(0)}), None,
     ValueError, r"_proj\.weight_perm': its act-order permutation differs.*'layers\.0\.self_attn\.qkv_proj'"),
]


@pytest.mark.parametrize("fmt,tensors,config,exc,message", BAD, ids=[f"{b[0]}-{b[4][:24]}" for b in BAD])
def test_bad_checkpoint_fails_at_load_naming_the_tensor(quant_models, tmp_path, fmt, tensors, config, exc, message):
    path = _broken(quant_models, fmt, tmp_path, tensors, config)
    with pytest.raises(exc, match=message):
        Engine(model=str(path), kv_cache_tokens=64)


def test_quantized_lm_head_is_refused(quant_models, tmp_path):
    def quantize_head(s):
        s["lm_head.weight_scale"] = torch.ones(1)
        s["lm_head.weight"] = s["lm_head.weight"].to(torch.float8_e4m3fn)

    path = _broken(quant_models, "ct-fp8-dynamic", tmp_path, quantize_head)
    with pytest.raises(QuantFormatError, match=r"'lm_head\.weight_scale' is quantized.*dense projections"):
        Engine(model=str(path), kv_cache_tokens=64)


def test_quantization_option(quant_models):
    """``[model] quantization``: a forced format must be the checkpoint's; "none" takes plain
    checkpoints only."""
    path, _ = quant_models["gptq"]
    for forced in ("awq", "none"):
        with pytest.raises(ConfigError, match=rf"'quantization': got '{forced}'.*'auto' or 'gptq'"):
            Engine(model=str(path), kv_cache_tokens=64, quantization=forced)
    with pytest.raises(ConfigError, match=r"'quantization': got 'fp8'.*not quantized"):
        Engine(model=str(quant_models["bases"]["llama"]), kv_cache_tokens=64, quantization="fp8")
    with pytest.raises(ConfigError, match=r"'quantization': got 'int3'"):
        Engine(model=str(path), kv_cache_tokens=64, quantization="int3")
    eng = Engine(model=str(path), kv_cache_tokens=64, quantization="gptq")
    asyncio.run(eng.stop())


def test_quantized_moe_experts_are_refused(tmp_path):
    """MoE experts stay unquantized for now: a checkpoint that quantizes them is refused by name."""
    base = make_tiny_checkpoint(tmp_path / "moe", "qwen3-moe", seed=7)
    path, _ = gptq_checkpoint(base, tmp_path / "moe-gptq")
    with pytest.raises(QuantFormatError, match=r"experts\.\d+\.\w+_proj\.qweight' is quantized, but radixd quantizes "
                                               r"only the decoder layers' dense projections"):
        Engine(model=str(path), kv_cache_tokens=64)


def test_ignored_layers_load_as_plain_weights(quant_models, tmp_path):
    """A projection on the quantizer's ignore list (a regex here) stays an ``nn.Linear`` of the
    checkpoint's float weights; the others are quantized; the logits are transformers'."""
    base = quant_models["bases"]["llama"]
    path = oneshot_checkpoint(base, tmp_path / "ignored", INT4_G32, ignore=("re:.*layers\\.0\\.mlp\\.down_proj$",))
    eng = make_engine(path)
    try:
        layers = eng.worker.model.layers
        assert type(layers[0].mlp.down_proj) is torch.nn.Linear
        assert isinstance(layers[1].mlp.down_proj, QuantLinear) and isinstance(layers[0].mlp.gate_up_proj, QuantLinear)
        p = prompts(1, 17, seed=10)[0]
        with torch.no_grad():
            want = _hf_model(path)(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(last_logits(eng, p), want, rtol=0, atol=EXACT)
    finally:
        asyncio.run(eng.stop())


@pytest.mark.parametrize("actorder,act_order", [(None, False), ("weight", False), ("static", False), ("group", True)])
def test_compressed_tensors_actorder(quant_models, actorder, act_order):
    """actorder "weight"/"static" only ordered the calibration (the plain layout); "group" stores
    each column's group in weight_g_idx, which each projection then must have."""
    from radixd.core.quant.formats import read_scheme

    hf = json.loads((quant_models["ct-w4a16-g32"][0] / "config.json").read_text())
    hf["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    scheme = read_scheme(hf)
    assert scheme.layout.act_order == act_order
    assert ("weight_g_idx" in scheme.required) == act_order


def test_daemon_serves_a_quantized_checkpoint_to_the_openai_client(quant_models, tmp_path):
    """``radixd --config`` with ``[model] quantization = "gptq"`` on a GPTQ checkpoint: the
    official client's greedy completion carries the engine's tokens (the same checkpoint in
    process)."""
    import openai
    from conftest import Daemon

    path, _ = quant_models["gptq-act-order"]
    prompt = prompts(1, 12, seed=6)[0]
    eng = make_engine(path)

    async def engine_tokens():
        try:
            return await collect(eng, prompt, 6)
        finally:
            await eng.stop()

    want = asyncio.run(engine_tokens())
    toml = f'[server]\nport = 0\n[model]\npath = "{path}"\nquantization = "gptq"\n[memory]\nkv_cache_tokens = 512\n'
    (tmp_path / "ok").mkdir()
    d = Daemon(tmp_path / "ok", toml)
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=path.name, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6
        assert out.choices[0].text == eng.tokenizer.decode(want)
    finally:
        assert d.stop() == 0
