"""The quantized linear ops (radixd.core.quant.ops): the layouts' helpers, the torch references
against a plain dequantize-then-matmul in float64, and the errors that name a bad tensor."""

from __future__ import annotations

import pytest
import torch

from radixd.core.quant import ops
from radixd.core.quant.ops import (
    FP8,
    FP8_MAX,
    dequantize_fp8,
    dequantize_int,
    fp8_linear,
    int_weight_linear,
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
    with pytest.raises(ValueError, match="group_size 48 does not divide K=256"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=48)
    with pytest.raises(ValueError, match="perm"):
        int_weight_linear(x, qw, sc, z, bits=4, group_size=64, perm=torch.arange(256, dtype=torch.int32))
