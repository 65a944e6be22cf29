"""Quantized checkpoints on a CUDA GPU (``-m gpu``): block fp8 and GPTQ int4 (plain and
act-order) through the Triton kernels, decode steps replayed from CUDA graphs give the eager
tokens, and prefill logits stay within bf16's reach of the CPU float32 reference; tensor
parallel over two GPUs where there are two. Checkpoints from ``quant_checkpoints``' writers
(nothing beyond torch, safetensors and transformers is needed)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_tiny_checkpoint
from quant_checkpoints import fp8_block_checkpoint, gptq_checkpoint, last_logits
from test_engine import collect, make_engine, prompts

from radixd.core.quant.linear import QuantLinear

pytestmark = pytest.mark.gpu
KINDS = {"fp8-block": lambda b, d: fp8_block_checkpoint(b, d),
         "gptq": lambda b, d: gptq_checkpoint(b, d)[0],
         "gptq-act-order": lambda b, d: gptq_checkpoint(b, d, desc_act=True)[0]}


@pytest.fixture(scope="module")
def gpu_quant_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_quant")
    base = make_tiny_checkpoint(root / "qwen3", "qwen3", seed=7)
    return {k: make(base, root / k) for k, make in KINDS.items()}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_cuda_graphs_give_the_eager_tokens(gpu_quant_models, kind):
    path = gpu_quant_models[kind]
    ps = prompts(3, 20, seed=1)
    runs = {}
    for graphs in (False, True):
        eng = make_engine(path, device="cuda", dtype="bfloat16", cuda_graphs=graphs)
        try:
            assert isinstance(eng.worker.model.layers[0].mlp.gate_up_proj, QuantLinear)
            assert (eng.worker.graphs is not None) == graphs
            runs[graphs] = [await collect(eng, ps[0], 12), *await asyncio.gather(*(collect(eng, p, 12) for p in ps))]
        finally:
            await eng.stop()
    assert runs[True] == runs[False]


@pytest.mark.parametrize("kind", list(KINDS))
async def test_cuda_prefill_logits_near_the_cpu_reference(gpu_quant_models, kind):
    """Within bf16's reach of the float32 reference: at most 1.5 times as far from it as the
    CPU's own bfloat16 run of the same checkpoint (plus 2% of the logits' scale). fp8
    checkpoints quantize activations too, and bf16 inputs round some of them to the next fp8
    value, so their bf16 runs sit about 10% of the scale away on both devices."""
    path = gpu_quant_models[kind]
    p = prompts(1, 40, seed=2)[0]
    got = {}
    for name, device, dtype in (("ref", "cpu", "float32"), ("cpu_bf16", "cpu", "bfloat16"), ("cuda", "cuda", "bfloat16")):
        eng = make_engine(path, device=device, dtype=dtype, cuda_graphs=False)
        try:
            got[name] = last_logits(eng, p).float().cpu()
        finally:
            await eng.stop()
    scale = float(got["ref"].abs().max())
    cpu_err = float((got["cpu_bf16"] - got["ref"]).abs().max()) / scale
    cuda_err = float((got["cuda"] - got["ref"]).abs().max()) / scale
    assert cuda_err <= 1.5 * cpu_err + 0.02, (cuda_err, cpu_err)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
async def test_tp2_on_two_gpus(gpu_quant_models):
    path = gpu_quant_models["gptq"]
    ps = prompts(2, 20, seed=4)
    runs = []
    for tp in (1, 2):
        eng = make_engine(path, device="cuda", dtype="float32", tp_size=tp)  # (fp32: sums in another order still round alike)
        try:
            runs.append(await asyncio.gather(*(collect(eng, p, 8) for p in ps)))
        finally:
            await eng.stop()
    assert runs[0] == runs[1]
