"""The quantized linear ops (radixd.core.quant.ops): the layouts' helpers, the torch references
against a plain dequantize-then-matmul in float64, the errors that name a bad tensor, and the
Triton kernels against the references: on CPU through the Triton interpreter at small shapes
(CI), on a GPU at Llama-3-8B's projection shapes (``-m gpu``)."""

from __future__ import annotations

import ast

import pytest
import torch

from radixd.core.quant import fp8_gemm, fp8_rows, gemv, ops
from radixd.core.quant.ops import (
    FP8,
    FP8_MAX,
    dequantize_fp8,
    dequantize_int,
    fp8_linear,
    fp8_linear_reference,
    int_weight_linear,
    int_weight_linear_reference,
    pack_int4,
    quantize_act_fp8,
    quantize_fp8,
    quantize_int,
    unpack_int4,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- layouts


def test_pack_int4_nibble_order_and_round_trip():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    word = pack_int4(q)
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) & 0xFFFFFFFF == 0xF7654321  # column 0 in the low nibble
    q = torch.randint(0, 16, (6, 40), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(q[:, :12])


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_quantize_fp8_layouts(granularity):
    w = rand(200, 300, seed=2)
    wq, s = quantize_fp8(w, granularity, block=(128, 128))
    assert wq.dtype == FP8 and s.dtype == torch.float32
    assert s.shape == {"tensor": (), "channel": (200,), "block": (2, 3)}[granularity]
    block = (128, 128) if granularity == "block" else None
    assert rel_err(dequantize_fp8(wq, s, block), w) < 0.04  # e4m3: 3 mantissa bits
    assert float(wq.float().abs().max()) == FP8_MAX  # the largest element of its scale group maps to 448


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 64, False), (8, 128, True), (8, 64, False),
                                                  (4, 128, False)])
def test_quantize_int_round_to_nearest(bits, group, symmetric):
    w = rand(24, 128, seed=3, dtype=torch.bfloat16)
    qw, s, z = quantize_int(w, bits, group, symmetric)
    assert qw.dtype == ops.INT_DTYPES[bits] and s.dtype == torch.bfloat16 and s.shape == (24, 128 // group)
    assert (z is None) == symmetric
    err = (dequantize_int(qw, s, z, bits, group) - w.float()).abs().view(24, -1, group)
    assert (err <= s.float()[..., None] * 0.5 + 1e-6).all()


def test_quantize_act_fp8_per_token_and_group():
    x = rand(3, 300, seed=4)
    x[1] = 0.0
    q, s = quantize_act_fp8(x)
    assert s.shape == (3, 1) and torch.isfinite(s).all() and (s > 0).all()
    assert torch.allclose(s[0, 0], x[0].abs().max() / FP8_MAX)
    assert (q[1].float() == 0).all()
    q, s = quantize_act_fp8(x, 128)
    assert s.shape == (3, 3)
    assert torch.allclose(s[2, 2], x[2, 256:].abs().max() / FP8_MAX)
    assert rel_err(q.float() * s.repeat_interleave(128, 1)[:, :300], x) < 0.04


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reference_is_dequantize_then_matmul(granularity, dtype):
    x, w, b = rand(5, 256, seed=5, dtype=dtype), rand(192, 256, seed=6), rand(192, seed=7, dtype=dtype)
    block = (128, 128) if granularity == "block" else None
    wq, s = quantize_fp8(w, granularity)
    y = fp8_linear(x, wq, s, block=block, bias=b)
    assert y.dtype == dtype and y.shape == (5, 192)
    xq, xs = quantize_act_fp8(x, 128 if block else None)
    xd = xq.double() * (xs.repeat_interleave(128, 1)[:, :256] if block else xs).double()
    want = xd @ dequantize_fp8(wq, s, block).double().T + b.double()
    assert rel_err(y, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(y, x.double() @ w.double().T + b.double()) < 0.06  # weight + activation rounding


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 64, False), (8, 64, True), (8, 256, False)])
def test_int_reference_is_dequantize_then_matmul(bits, group, symmetric):
    x, w = rand(4, 256, seed=8, dtype=torch.bfloat16), rand(96, 256, seed=9, dtype=torch.bfloat16)
    qw, s, z = quantize_int(w, bits, group, symmetric)
    y = int_weight_linear(x, qw, s, z, bits=bits, group_size=group)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, x.double() @ dequantize_int(qw, s, z, bits, group).double().T) < 1e-2


@pytest.mark.parametrize("bits,symmetric", [(4, False), (8, True)])
def test_int_partial_last_group(bits, symmetric):
    """K = 320 in groups of 128: two whole groups and one of 64 columns (SmolLM2's K = 576 is
    4.5 groups of 128)."""
    w = rand(16, 320, seed=13)
    qw, s, z = quantize_int(w, bits, 128, symmetric)
    assert s.shape == (16, 3)
    err = (dequantize_int(qw, s, z, bits, 128) - w).abs()
    assert (err <= s.repeat_interleave(128, 1)[:, :320] * 0.5 + 1e-6).all()
    x = rand(2, 320, seed=14)
    y = int_weight_linear(x, qw, s, z, bits=bits, group_size=128)
    assert rel_err(y, x.double() @ dequantize_int(qw, s, z, bits, 128).double().T) < 1e-6


def test_int_reference_act_order_reads_x_through_perm():
    k = 128
    w = rand(32, k, seed=10)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(11))
    # the checkpoint's weight over original columns; stored permuted so that groups are contiguous
    qw, s, z = quantize_int(w[:, perm], 4, 32, False)
    x = rand(3, k, seed=12)
    y = int_weight_linear(x, qw, s, z, bits=4, group_size=32, perm=perm)
    w_orig = torch.empty(32, k, dtype=torch.float64)
    w_orig[:, perm] = dequantize_int(qw, s, z, 4, 32).double()
    assert rel_err(y, x.double() @ w_orig.T) < 1e-6


def test_bad_layouts_name_the_tensor():
    x = rand(2, 256)
    wq, s = quantize_fp8(rand(64, 256), "channel")
    with pytest.raises(ValueError, match=r"weight_scale: shape \(32,\), expected \[\] or \[64\]"):
        fp8_linear(x, wq, s[:32])
    with pytest.raises(ValueError, match=r"expected \[1, 2\] for \[64, 256\] in blocks \[128, 128\]"):
        fp8_linear(x, wq, s, block=(128, 128))
    with pytest.raises(ValueError, match="fp8 weight: dtype"):
        fp8_linear(x, wq.float(), s)
    qw, sc, z = quantize_int(rand(64, 256), 4, 64, False)
    with pytest.raises(ValueError, match=r"scales: shape \(64, 4\), expected \[64, 2\] \(group_size 128\)"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=128)
    with pytest.raises(ValueError, match=r"qweight: torch.int32 \(64, 32\), expected torch.uint8 \[64, 256\]"):
        int_weight_linear(x, qw, sc, z, bits=8, group_size=64)
    with pytest.raises(ValueError, match=r"scales: shape \(64, 4\), expected \[64, 6\] \(group_size 48\)"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=48)
    with pytest.raises(ValueError, match="group_size must be positive"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=0)
    with pytest.raises(ValueError, match="perm"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=64, perm=torch.arange(256, dtype=torch.int32))


# ----------------------------------------------------------------------------- kernels

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
interpreter = pytest.mark.skipif(GPU, reason="the interpreter runs the kernels on CPU tensors; -m gpu covers CUDA")


def weight_only(x, w_deq, bias=None):
    """x @ W.T in float64: what a GEMV that keeps x unquantized computes."""
    y = x.double() @ w_deq.double().T
    return y + bias.double() if bias is not None else y


FP8_CASES = [("tensor", 256, False), ("channel", 200, True), ("block", 300, True)]


@interpreter
def test_act_quant_kernel_matches_the_reference_exactly(monkeypatch):
    x = rand(5, 300, seed=20)
    x[2] = 0.0
    for group, row_in_registers in ((None, 512), (None, 128), (128, 512)):  # (a row in one pass, in two)
        monkeypatch.setattr(fp8_gemm, "ROW_IN_REGISTERS", row_in_registers)
        q, s = fp8_gemm.quantize_act(x, group)
        rq, rs = quantize_act_fp8(x, group)
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


@interpreter
@pytest.mark.parametrize("granularity,k,with_bias", FP8_CASES)
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_gemv_kernel(granularity, k, with_bias, m):
    n = 40
    block = (32, 128) if granularity == "block" else None
    wq, s = quantize_fp8(rand(n, k, seed=21), granularity, block=block or (128, 128))
    x = rand(m, k, seed=22)
    b = rand(n, seed=23) if with_bias else None
    y = gemv.fp8_gemv(x, wq, s, block, b)  # (ops takes it for one row; the kernel takes up to 4)
    assert rel_err(y, weight_only(x, dequantize_fp8(wq, s, block), b)) < 1e-5
    assert rel_err(y, fp8_linear_reference(x, wq, s, block=block, bias=b)) < 0.05  # x unquantized in the GEMV


@interpreter
@pytest.mark.parametrize("granularity,k,with_bias", FP8_CASES)
def test_fp8_gemm_kernel(granularity, k, with_bias):
    m, n = 20, 72
    block = (32, 128) if granularity == "block" else None
    wq, s = quantize_fp8(rand(n, k, seed=24), granularity, block=block or (128, 128))
    x = rand(m, k, seed=25)
    b = rand(n, seed=26) if with_bias else None
    y = fp8_linear(x, wq, s, block=block, bias=b, use_triton=True)
    assert rel_err(y, fp8_linear_reference(x, wq, s, block=block, bias=b)) < 1e-5


ROWS_CASES = [  # (rows, N, K, silu, bias, granularity, mode, tiles)
    (5, 40, 256, False, True, "channel", fp8_rows.W8A16, (16, 64, 1, 1, 1)),
    (3, 48, 256, True, False, "channel", fp8_rows.W8A16, (16, 64, 1, 1, 2)),
    (20, 72, 300, False, True, "channel", fp8_rows.A8W8, (16, 64, 1, 1, 2)),   # K not a multiple of the step
    (7, 64, 512, False, False, "tensor", fp8_rows.W8A16, (32, 64, 1, 1, 4)),
    (9, 40, 256, True, False, "tensor", fp8_rows.A8W8, (16, 32, 1, 1, 3)),     # splits not dividing K evenly
]


@interpreter
@pytest.mark.parametrize("m,n,k,silu,with_bias,granularity,mode,tiles", ROWS_CASES)
def test_fp8_rows_kernel(m, n, k, silu, with_bias, granularity, mode, tiles):
    """The few-rows kernel in both modes, with SiLU * up, a bias and K split over programs:
    W8A16 is the product with x unquantized, A8W8 the reference's fake-quantized one."""
    wq, s = quantize_fp8(rand(2 * n if silu else n, k, seed=40), granularity)
    x = rand(m, k, seed=41)
    b = rand(n, seed=42) if with_bias else None
    y = fp8_rows.fp8_rows(x, wq, s, b, silu=silu, mode=mode, tiles=tiles)
    if mode == fp8_rows.W8A16:
        want = weight_only(x, dequantize_fp8(wq, s), b)
    else:
        want = fp8_linear_reference(x, wq, s, bias=b).double()
    if silu:
        want = silu_of(want)
    assert y.shape == (m, n) and rel_err(y, want) < 1e-5


INT_CASES = [(4, 32, True, False, 256), (4, 64, False, True, 256), (4, 256, False, False, 256),
             (8, 64, False, False, 256), (8, 128, True, True, 256),
             (4, 320, False, True, 320),   # per channel, K not a multiple of 128
             (4, 128, False, False, 320), (8, 128, True, False, 320)]  # a last group of 64 columns


def int_case(bits, group, symmetric, act_order, k, n=40, seed=30):
    qw, s, z = quantize_int(rand(n, k, seed=seed), bits, group, symmetric)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else None
    return qw, s, z, perm


@interpreter
@pytest.mark.parametrize("bits,group,symmetric,act_order,k", INT_CASES)
@pytest.mark.parametrize("m", [1, 3])
def test_int_gemv_kernel(bits, group, symmetric, act_order, k, m):
    qw, s, z, perm = int_case(bits, group, symmetric, act_order, k)
    x, b = rand(m, k, seed=31), rand(40, seed=32)
    y = gemv.int_gemv(x, qw, s, z, bits, group, perm, b)  # (ops takes it for one row; the kernel takes up to 4)
    ref = int_weight_linear_reference(x, qw, s, z, bits=bits, group_size=group, perm=perm, bias=b)
    assert rel_err(y, ref) < 1e-5


def silu_of(y):
    gate, up = y.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@interpreter
@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block", "int4-asym", "int8"])
def test_gemv_with_silu_is_the_activation_of_its_product(fmt):
    """gate | up rows in each program's tile, SiLU(gate) * up in the epilogue; N = 2 x 36 is
    not a multiple of the tile's 4 gate rows, so the last tile's extra rows are masked."""
    n, k = 72, 256
    x = rand(1, k, seed=27)
    if fmt.startswith("fp8"):
        block = (32, 128) if fmt == "fp8-block" else None
        wq, s = quantize_fp8(rand(n, k, seed=28), fmt[4:], block=block or (128, 128))
        y = gemv.fp8_gemv(x, wq, s, block, None, silu=True, tiles=(8, 128, 4))
        plain = gemv.fp8_gemv(x, wq, s, block, None, tiles=(8, 128, 4))
    else:
        bits = 4 if fmt.startswith("int4") else 8
        qw, s, z, perm = int_case(bits, 64, bits == 8, False, k, n=n)
        y = gemv.int_gemv(x, qw, s, z, bits, 64, perm, None, silu=True, tiles=(8, 128, 4))
        plain = gemv.int_gemv(x, qw, s, z, bits, 64, perm, None, tiles=(8, 128, 4))
    assert y.shape == (1, n // 2)
    assert rel_err(y, silu_of(plain)) < 1e-6
    with pytest.raises(ValueError, match="silu"):
        gemv.fp8_gemv(rand(2, k, seed=29), *quantize_fp8(rand(n, k, seed=28), "channel"), None, None, silu=True)


def rope_case(heads, kv_heads, dim, kv_dtype, device):
    from radixd.core.models.layers import Rotary

    rot = Rotary(dim, 4096, 500000.0, None).to(device)
    kb = torch.zeros(10, kv_heads, dim, device=device, dtype=kv_dtype)
    return rot, kb, torch.zeros_like(kb)


def fused_vs_unfused_rope(gemv_fn, n, heads, kv_heads, dim, kv_dtype, device, bias=None):
    """q/k/v stored by ``gemv_fn(rope=...)`` and by the plain GEMV + ``rope_store``: (q, k slot,
    v slot) of each, and whether any other slot was written."""
    from radixd.core.triton_ops import rope_store

    rot, kb, vb = rope_case(heads, kv_heads, dim, kv_dtype, device)
    pos, loc = torch.tensor([1234], device=device), torch.tensor([7], device=device)
    scales = (0.5, 0.25) if kv_dtype.itemsize == 1 else (1.0, 1.0)
    q = gemv_fn(rope=gemv.RopeStore(pos, rot.cos, rot.sin, kb, vb, loc, heads, *scales))
    qkv = gemv_fn()
    rq, rk, rv = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    rq = rq.reshape(1, heads, dim).contiguous()
    _, kb2, vb2 = rope_case(heads, kv_heads, dim, kv_dtype, device)
    rope_store(rq, rk.reshape(1, kv_heads, dim), rv.reshape(1, kv_heads, dim), pos, rot.cos, rot.sin, kb2, vb2, loc,
               *scales)
    others = torch.ones(10, dtype=torch.bool)
    others[7] = False
    return (q, kb[7], vb[7]), (rq, kb2[7], vb2[7]), bool(kb[others].float().any() or vb[others].float().any())


@interpreter
@pytest.mark.parametrize("fmt,kv", [("fp8-channel", "model"), ("fp8-block", "fp8"), ("int4-asym-bias", "model"),
                                    ("int8", "fp8")])
def test_gemv_with_rope_stores_what_the_unfused_path_stores(fmt, kv):
    """q/k/v of one token with rotary and the K/V store in the GEMV's epilogue: the same q and
    the same stored K/V as the GEMV followed by ``rope_store`` (also into an fp8 pool)."""
    heads, kv_heads, dim, k = 4, 2, 16, 256
    n = (heads + 2 * kv_heads) * dim
    x = rand(1, k, seed=40)
    kv_dtype = ops.FP8 if kv == "fp8" else torch.float32
    if fmt.startswith("fp8"):
        block = (32, 128) if fmt == "fp8-block" else None
        wq, s = quantize_fp8(rand(n, k, seed=41), fmt[4:], block=block or (128, 128))

        def run(**epi):
            return gemv.fp8_gemv(x, wq, s, block, None, tiles=(8, 128, 4), **epi)
    else:
        bits = 4 if fmt.startswith("int4") else 8
        qw, s, z, perm = int_case(bits, 64, bits == 8, False, k, n=n)
        b = rand(n, seed=42) if fmt.endswith("bias") else None

        def run(**epi):
            return gemv.int_gemv(x, qw, s, z, bits, 64, perm, b, tiles=(8, 128, 4), **epi)
    fused, unfused, stray = fused_vs_unfused_rope(run, n, heads, kv_heads, dim, kv_dtype, DEV)
    assert fused[0].shape == (1, heads, dim)
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got.float(), want.float())
    assert not stray  # only the token's slot is written


@interpreter
@pytest.mark.parametrize("bits,group,symmetric,act_order,k", INT_CASES)
def test_int_gemm_kernel(bits, group, symmetric, act_order, k):
    qw, s, z, perm = int_case(bits, group, symmetric, act_order, k, n=72)
    x, b = rand(20, k, seed=33), rand(72, seed=34)
    y = int_weight_linear(x, qw, s, z, bits=bits, group_size=group, perm=perm, bias=b, use_triton=True)
    ref = int_weight_linear_reference(x, qw, s, z, bits=bits, group_size=group, perm=perm, bias=b)
    assert rel_err(y, ref) < 1e-5


@interpreter
def test_dispatch_by_device_and_rows(monkeypatch):
    """CPU tensors take the reference unless asked; 1..GEMV_MAX_M rows the GEMV, more the GEMM."""
    calls = []
    for mod, name in ((ops, "fp8_gemv"), (ops, "fp8_gemm"), (ops, "int_gemv"), (ops, "int_gemm")):
        monkeypatch.setattr(mod, name, lambda *a, name=name, **kw: calls.append(name))
    wq, s = quantize_fp8(rand(16, 64), "channel")
    qw, sc, z = quantize_int(rand(16, 64), 4, 32, False)
    for m in (1, gemv.GEMV_MAX_M, gemv.GEMV_MAX_M + 1):
        x = rand(m, 64)
        assert fp8_linear(x, wq, s).shape == (m, 16)  # the reference
        fp8_linear(x, wq, s, use_triton=True)
        int_weight_linear(x, qw, sc, z, bits=4, group_size=32, use_triton=True)
    assert calls == ["fp8_gemv", "int_gemv"] * 2 + ["fp8_gemm", "int_gemm"]


def test_benchmark_quick_runs_every_case(tmp_path):
    """``python -m benchmarks.quant_kernels --quick``: every shape, row count and format on
    tiny CPU shapes (kernels through the interpreter), and a sweep, without an error."""
    import json

    from benchmarks import quant_kernels

    assert quant_kernels.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "quant_kernels.json").read_text())
    cases = [r for shape in quant_kernels.QUICK_SHAPES for m, row in doc[shape].items() if m.startswith("M=")
             for r in row.values() if isinstance(r, dict)]
    assert len(cases) == len(quant_kernels.QUICK_SHAPES) * len(quant_kernels.QUICK_ROWS) * (1 + len(quant_kernels.FORMATS))
    assert not [r for r in cases if "error" in r]
    assert all(r["rel_err_vs_reference"] < 0.05 for r in cases if "rel_err_vs_reference" in r)
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"cpu": {"fp8 channel 1x1": [2, 16, 1]}}))
    assert quant_kernels.main(["--quick", "--out", str(tmp_path), "--sweep", "--rows", "1,20",
                               "--formats", "int4_g128_asym,fp8_block", "--write-tuned", str(tuned)]) == 0
    doc = json.loads((tmp_path / "quant_kernels.json").read_text())["tiny"]
    best = doc["M=1"]["int4_g128_asym"]["sweep"]["best"]
    assert best and doc["M=20"]["fp8_block"]["sweep"]["best"]
    n, k = doc["N_K"]
    written = json.loads(tuned.read_text())["cpu"]  # (merged into what the file held)
    assert written[gemv.tuned_key(gemv.int_kind(4, 128, False), n, k)] == list(ast.literal_eval(best))
    assert written["fp8 channel 1x1"] == [2, 16, 1] and f"fp8 block128x128 {n}x{k}" in written


# ----------------------------------------------------------------------------- GPU, real shapes

SHAPES_8B = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # o, qkv, gate_up, down (N, K)
GPU_ROWS = [1, 4, 64, 512]


def _gpu_input(m, k, seed):
    return (torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
            .to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_kernels_at_8b_shapes_on_gpu(n, k, granularity):
    block = (128, 128) if granularity == "block" else None
    w = torch.randn(n, k, device="cuda") * k**-0.5
    wq, s = quantize_fp8(w, granularity)
    w_deq = dequantize_fp8(wq, s, block)
    for m in GPU_ROWS:
        x = _gpu_input(m, k, m)
        y = fp8_linear(x, wq, s, block=block)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        ref = fp8_linear_reference(x, wq, s, block=block)
        choice = fp8_rows.choose(m, n, k, False, x.device) if granularity == "channel" else None
        if m <= gemv.GEMV_MAX_M or (choice and choice[:2] == ["rows", fp8_rows.W8A16]):
            # x unquantized: against the weight-only product, and loosely the reference
            assert rel_err(y, weight_only(x, w_deq)) < 1e-2, m
            assert rel_err(y, ref) < 0.05, m
        else:  # bf16 output rounding and fp32 accumulation order
            assert rel_err(y, ref) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("bits,group,symmetric,act_order", [(4, 128, True, False), (4, 128, False, True),
                                                            (8, 128, True, False), (4, 4096, False, False)])
# (groups of 4096: per channel where K = 4096, a last group of 2048 columns where K = 14336)
def test_int_kernels_at_8b_shapes_on_gpu(n, k, bits, group, symmetric, act_order):
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    qw, s, z = quantize_int(w, bits, group, symmetric)
    perm = torch.randperm(k, device="cuda") if act_order else None
    for m in GPU_ROWS:
        x = _gpu_input(m, k, m)
        y = int_weight_linear(x, qw, s, z, bits=bits, group_size=group, perm=perm)
        ref = int_weight_linear_reference(x, qw, s, z, bits=bits, group_size=group, perm=perm)
        assert rel_err(y, ref) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block", "int4-sym", "int4-asym", "int4-actorder"])
def test_gemv_with_silu_on_gpu(fmt):
    """The gate_up projection of one token with SiLU(gate) * up in the GEMV's epilogue, at the
    8B shape, against the activation of the unfused GEMV's output."""
    n, k = 28672, 4096
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    x = _gpu_input(1, k, 7)
    if fmt.startswith("fp8"):
        block = (128, 128) if fmt == "fp8-block" else None
        wq, s = quantize_fp8(w.float(), fmt[4:])
        y, plain = (gemv.fp8_gemv(x, wq, s, block, None, silu=silu) for silu in (True, False))
    else:
        qw, s, z = quantize_int(w, 4, 128, fmt != "int4-asym")
        perm = torch.randperm(k, device="cuda") if fmt == "int4-actorder" else None
        y, plain = (gemv.int_gemv(x, qw, s, z, 4, 128, perm, None, silu=silu) for silu in (True, False))
    assert y.shape == (1, n // 2) and torch.isfinite(y).all()
    assert rel_err(y, silu_of(plain)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block", "int4-sym", "int4-asym", "int4-actorder"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gemv_with_rope_on_gpu(fmt, kv):
    """The 8B q/k/v projection of one token with rotary and the K/V store in the GEMV's
    epilogue, against the unfused GEMV + ``rope_store`` on the same weights."""
    heads, kv_heads, dim, k = 32, 8, 128, 4096
    n = (heads + 2 * kv_heads) * dim
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    x = _gpu_input(1, k, 11)
    if fmt.startswith("fp8"):
        block = (128, 128) if fmt == "fp8-block" else None
        wq, s = quantize_fp8(w.float(), fmt[4:])

        def run(**epi):
            return gemv.fp8_gemv(x, wq, s, block, None, **epi)
    else:
        qw, s, z = quantize_int(w, 4, 128, fmt != "int4-asym")
        perm = torch.randperm(k, device="cuda") if fmt == "int4-actorder" else None

        def run(**epi):
            return gemv.int_gemv(x, qw, s, z, 4, 128, perm, None, **epi)
    kv_dtype = ops.FP8 if kv == "fp8" else torch.bfloat16
    fused, unfused, stray = fused_vs_unfused_rope(run, n, heads, kv_heads, dim, kv_dtype, "cuda")
    for got, want in zip(fused, unfused, strict=True):
        assert torch.isfinite(got.float()).all() and rel_err(got, want) < 1e-2
    assert not stray


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,silu", [(6144, 4096, False), (4096, 14336, False), (14336, 4096, True)])
@pytest.mark.parametrize("mode", [fp8_rows.W8A16, fp8_rows.A8W8])
def test_fp8_rows_at_8b_shapes_on_gpu(n, k, silu, mode):
    """``fp8_rows`` on the GPU (W8A16 through the inline-PTX widening for bf16 x) at decode
    batch sizes, with K split, against the float64 product of what each mode multiplies."""
    w = torch.randn(2 * n if silu else n, k, device="cuda") * k**-0.5
    wq, s = quantize_fp8(w, "channel")
    w_deq = dequantize_fp8(wq, s)
    for m, tiles in ((2, (64, 128, 4, 4, 1)), (16, (64, 256, 4, 3, 2)), (64, (64, 128, 4, 4, 4)),
                     (100, (128, 128, 8, 4, 1))):
        x = _gpu_input(m, k, m)
        y = fp8_rows.fp8_rows(x, wq, s, silu=silu, mode=mode, tiles=tiles)
        if mode == fp8_rows.W8A16:
            want = weight_only(x, w_deq)
        else:
            xq, xs = quantize_act_fp8(x)
            want = weight_only(xq.double() * xs.double(), w_deq)
        if silu:
            want = silu_of(want)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert rel_err(y, want) < 1e-2, (m, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(3, 4096), (64, 4096), (64, 14336), (300, 14336), (512, 4096)])
def test_act_quant_kernel_on_gpu_matches_the_reference_exactly(m, k):
    """The per-token activation quantization on the GPU (its own fp8 conversion, the few-rows
    launch up to ``FEW_ROWS``, one pass or two) gives the reference's bytes and scales."""
    x = _gpu_input(m, k, m) * 3
    x[1] = 0.0
    q, s = fp8_gemm.quantize_act(x)
    rq, rs = quantize_act_fp8(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))

