"""radixd's C kernels for the CPU (``cpu_kernels``): decode attention over the pool equals an
explicit softmax(q.k) v over each request's slots, for the head groups and head sizes the
dispatcher specializes and for others, with the AVX512-BF16 kernel and without
(``RADIXD_CPU_ISA=baseline``) and without AMX (``RADIXD_CPU_ISA=vnni``); the int4 weight read back from torch's packing equals
the weight torch's int4 kernel multiplies by; the grouped int8 matmul equals its definition,
across its 8-row chunks; the VNNI integer kernels (int4 / int8 weights, int8 activations per
block of 32) equal a float reference on the same quantized activations at 1-16 rows and odd
column counts, and stay within a stated distance of the float product; under
``RADIXD_CPU_ISA=baseline`` weights are packed for torch's kernels instead; the library is
built once into the cache, and without a compiler (or switched off) it is None and the callers
keep torch's paths."""

from __future__ import annotations

import logging

import pytest
import torch

from radixd.core import cpu_kernels, cpu_setup
from radixd.core.quant.cpu_int import (
    DEQUANT_ROWS,
    GEMM_ROWS,
    CpuIntWeight,
    cpu_int_linear,
    pack_cpu,
    pack_records,
    rows,
)
from radixd.core.quant.ops import pack_int4

needs_vnni = pytest.mark.skipif(not cpu_kernels.vnni(), reason="this CPU has no AVX512-VNNI (the fallback is tested)")
needs_amx = pytest.mark.skipif(not cpu_kernels.amx(), reason="this CPU has no AMX-INT8 (its fallback, VNNI, is tested)")


@pytest.fixture
def baseline(monkeypatch):
    """The kernels that need no CPU extension only (what a CPU without VNNI / BF16 runs)."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "baseline")
    cpu_kernels.reset()
    yield
    monkeypatch.undo()
    cpu_kernels.reset()


@pytest.fixture
def no_amx(monkeypatch):
    """Every kernel this CPU has but AMX (what a CPU with AVX512 but without AMX runs)."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "vnni")
    cpu_kernels.reset()
    assert not cpu_kernels.amx()
    yield
    monkeypatch.undo()
    cpu_kernels.reset()


@pytest.fixture
def avx2(monkeypatch):
    """The AVX2 kernels (``RADIXD_CPU_ISA=avx2``: what a CPU with AVX2, FMA and F16C but no
    AVX512 runs), on any CPU that has them."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    cpu_kernels.reset()
    if not cpu_kernels.avx2():
        pytest.skip("this CPU has no AVX2 / FMA / F16C")
    assert not cpu_kernels.vnni() and not cpu_kernels.bf16dp() and not cpu_kernels.amx() and cpu_kernels.records()
    yield
    monkeypatch.undo()
    cpu_kernels.reset()


def reference_decode(q, k_buf, v_buf, slots, lens, scale):
    out = []
    for b, n in enumerate(lens.tolist()):
        idx = slots[b, :n]
        group = q.shape[1] // k_buf.shape[1]
        k = k_buf[idx].float().repeat_interleave(group, 1)  # [n, H, D]
        v = v_buf[idx].float().repeat_interleave(group, 1)
        w = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("isa", ["native", "no_amx", "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 2, 48), (16, 1, 32)])
def test_decode_matches_softmax_attention(dtype, heads, kv_heads, dim, isa, request):
    """(natively on a CPU with AMX-BF16 a bf16 pool's scores come from tiles: keys read in
    place where 16 slots follow each other, as rows 2 and 3's shared prefix does, else gathered)"""
    if isa != "native":
        request.getfixturevalue(isa)
    g = torch.Generator().manual_seed(heads * dim)
    k_buf = torch.randn(400, kv_heads, dim, generator=g).to(dtype)
    v_buf = torch.randn(400, kv_heads, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 120, 64])
    slots = torch.zeros(4, 120, dtype=torch.int64)
    shared = torch.arange(1, 60)
    for b, n in enumerate(lens.tolist()):  # rows 2 and 3 share a prefix; the rest scattered
        own = torch.randperm(340, generator=g)[:n] + 60
        slots[b, :n] = torch.cat((shared, own))[:n] if b >= 2 else own
    q = torch.randn(4, heads, dim, generator=g).to(dtype)
    assert cpu_kernels.takes(dtype, k_buf, heads)
    got = cpu_kernels.decode(q, k_buf, v_buf, slots, lens, dim**-0.5)
    want = reference_decode(q, k_buf, v_buf, slots, lens, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype


@needs_amx
@pytest.mark.skipif(not cpu_kernels.bf16dp(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (16, 1, 32), (8, 2, 128)])
def test_amx_attention_scores_equal_the_avx512_kernels(heads, kv_heads, dim):
    """Scores from AMX-BF16 tiles are the same bf16 products summed in float32 in another
    order: with sharp softmaxes (queries x 4) the outputs stay within a bf16 rounding of the
    AVX512-BF16 kernel's, for keys read in place (16 slots that follow each other) and gathered."""
    lib = cpu_kernels.library()
    g = torch.Generator().manual_seed(dim + heads)
    k_buf = torch.randn(700, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(700, kv_heads, dim, generator=g).to(torch.bfloat16)
    lens = torch.tensor([5, 16, 83, 300, 290])
    slots = torch.zeros(5, 300, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = torch.arange(10, 10 + n) if b % 2 else torch.randperm(690, generator=g)[:n] + 10
    q = (4 * torch.randn(5, heads, dim, generator=g)).to(torch.bfloat16)
    got = {}
    try:
        for on in (1, 0):
            lib.set_amx(on)
            before = cpu_kernels.thread_stats()["amx_units"]
            got[on] = cpu_kernels.decode(q, k_buf, v_buf, slots, lens, dim**-0.5).float()
            assert (cpu_kernels.thread_stats()["amx_units"] > before) == bool(on)  # (the tiles ran, or not)
    finally:
        lib.set_amx(1)
    torch.testing.assert_close(got[1], got[0], atol=2**-8 * got[0].abs().max().item(), rtol=0)


def test_decode_refuses_what_it_does_not_take():
    k = torch.zeros(10, 2, 64)
    assert not cpu_kernels.takes(torch.float16, k.half(), 4)        # no fp16 kernel
    assert not cpu_kernels.takes(torch.float32, k, 3)               # heads not a multiple of KV heads
    assert not cpu_kernels.takes(torch.float32, k, 2 * 17)          # a group over 16
    assert not cpu_kernels.takes(torch.float32, torch.zeros(10, 2, 512), 4)  # head_dim over 256
    assert not cpu_kernels.takes(torch.float32, torch.zeros(2, 10, 64).transpose(0, 1), 4)  # not contiguous
    assert cpu_kernels.takes(torch.float32, k, 4)


@pytest.mark.parametrize("block", cpu_kernels.INT4PACK_BLOCKS)
def test_int4pack_layouts_read_back(block):
    """Both of torch's CPU int4 packings (blocks of 64 rows, AVX512; of 32, AVX2), written here
    by hand, read back whichever this machine's torch writes."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler for radixd's CPU kernels")
    g = torch.Generator().manual_seed(block)
    n, k, group = 128, 96, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    rows = q.reshape(n // block, 2, block // 2, k)  # [block, low/high nibble, byte, k]
    packed = (rows[:, 0] | rows[:, 1] << 4).permute(0, 2, 1).to(torch.uint8).contiguous()  # [N/B, K, B/2]
    scales = torch.rand(k // group, n, generator=g) + 0.5
    zeros = torch.randn(k // group, n, generator=g)
    sz = torch.stack([scales, zeros], -1).to(torch.bfloat16)
    got = cpu_kernels._int4pack_to_bf16(packed.view(n, k // 2), sz, n, k, group, block)
    s, z = (sz[..., i].float().repeat_interleave(group, 0) for i in (0, 1))  # [k, n]
    want = ((q.t().float() - 8) * s + z).to(torch.bfloat16)
    assert torch.equal(got, want)
    other = next(b for b in cpu_kernels.INT4PACK_BLOCKS if b != block)
    assert not torch.equal(cpu_kernels._int4pack_to_bf16(packed.view(n, k // 2), sz, n, k, group, other), want)


def test_int4_weight_read_back_is_what_the_int4_kernel_multiplies(baseline, monkeypatch):
    assert cpu_kernels.int4pack_readable()
    monkeypatch.setattr(cpu_setup, "native_bf16", lambda: True)  # (the dequantized path on any CPU)
    g = torch.Generator().manual_seed(1)
    n, k, group = 192, 256, 64
    q = torch.randint(0, 16, (n, k // 8), dtype=torch.int32, generator=g)  # canonical packed int4
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    for i in range(8):
        qw |= ((q >> (4 * i)) & 15) << (4 * i)
    scales = torch.rand(n, k // group, generator=g) + 0.5
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    w = pack_cpu(qw, scales, zeros, 4, group)
    assert w.kind == "torch"  # (baseline: torch's packing)
    dense = cpu_kernels.int4pack_to_bf16(w.q, w.scales, n, k, group)  # [k, n]
    assert dense.shape == (k, n) and dense.dtype == torch.bfloat16
    unpacked = torch.stack([(q >> (4 * i)) & 15 for i in range(8)], -1).reshape(n, k).float()
    canonical = (unpacked - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    torch.testing.assert_close(dense.float(), canonical.t(), atol=0.08, rtol=8e-3)  # (bf16 scale, zero, values)
    x = torch.randn(DEQUANT_ROWS, k, generator=g).to(torch.bfloat16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.q, group, w.scales).float()
    torch.testing.assert_close(x.float() @ dense.float(), kernel, atol=1e-2 * kernel.abs().max().item(), rtol=0)
    # and the linear's two paths agree: few rows through the int4 kernel, more dequantized
    rows = torch.randn(2 * DEQUANT_ROWS, k, generator=g)
    few = torch.cat([cpu_int_linear(rows[i : i + DEQUANT_ROWS], w) for i in (0, DEQUANT_ROWS)])
    torch.testing.assert_close(cpu_int_linear(rows, w), few, atol=1e-2 * few.abs().max().item(), rtol=0)
    assert w.dense_bytes == 2 * n * k
    monkeypatch.setattr(cpu_setup, "native_bf16", lambda: False)  # an AVX2 CPU: no bf16 copy, no dequantizing
    assert w.dense_bytes == 0 and not w.dequantizable
    torch.testing.assert_close(cpu_int_linear(rows, w), few, atol=1e-2 * few.abs().max().item(), rtol=0)


@pytest.mark.parametrize("group", [32, 64])
def test_int8_matmul_matches_its_definition(group):
    g = torch.Generator().manual_seed(group)
    n, k = 80, 4 * group
    q = torch.randint(-127, 128, (k // group, n, group), dtype=torch.int8, generator=g)
    s = (torch.rand(k // group, n, generator=g) * 0.05).to(torch.bfloat16)
    weight = (q.float() * s.float()[..., None]).transpose(0, 1).reshape(n, k)  # [N, K]
    for m in (1, 3, 8, 11):  # across the kernel's chunks of 8 rows
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(cpu_kernels.int8_matmul(x, q, s), x @ weight.t(), atol=1e-3, rtol=1e-4)
    w = CpuIntWeight(8, n, k, group, q, s)
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(cpu_int_linear(x, w).float(), (x.float() @ weight.t()), atol=0.05, rtol=1e-2)


def test_library_is_built_once_and_optional(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RADIXD_CACHE", str(tmp_path))
    # unoptimised (2 s to compile here, not 40): what is checked is the build, the cache and the
    # load, with the flags and the link of the real one; its -O3 build is every other test's
    assert cpu_kernels.FLAGS[0] == "-O3"
    monkeypatch.setattr(cpu_kernels, "FLAGS", ("-O0", *cpu_kernels.FLAGS[1:]))
    cpu_kernels.library.cache_clear()
    try:
        lib = cpu_kernels.library()
        assert lib is not None
        # loading it leaves the process's float state alone (no flush-to-zero: subnormals stay)
        assert (torch.tensor(1e-40) * 1.0).item() != 0.0
        built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None
        assert built[0].stat().st_mtime_ns == stamp and len(list((tmp_path / "kernels").iterdir())) == 1

        cpu_kernels.library.cache_clear()
        monkeypatch.setenv("RADIXD_CPU_KERNELS", "off")
        assert cpu_kernels.library() is None
        assert not cpu_kernels.takes(torch.float32, torch.zeros(4, 1, 8), 1)

        cpu_kernels.library.cache_clear()
        monkeypatch.delenv("RADIXD_CPU_KERNELS")
        monkeypatch.setenv("RADIXD_CACHE", str(tmp_path / "other"))
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        with caplog.at_level(logging.WARNING, logger="radixd.core.cpu_kernels"):
            assert cpu_kernels.library() is None
        assert "building the CPU kernels failed" in caplog.text
        assert not list((tmp_path / "other" / "kernels").glob("*.so"))  # no half-written library left
    finally:
        cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_equal_torchs_paths(dtype, monkeypatch):
    from radixd.core.models.layers import Rotary
    from radixd.core.triton_ops import add_rmsnorm

    g = torch.Generator().manual_seed(7)
    x, res, w = (torch.randn(*s, generator=g).to(dtype) for s in ((5, 96), (5, 96), (96,)))
    rot = Rotary(32, 512, 10000.0, None)
    qkv = torch.randn(5, 7, 32, generator=g).to(dtype)  # q, k: views of one projection, as the layers make them
    q, k = qkv[:, :4], qkv[:, 4:6]
    pos = torch.tensor([0, 3, 100, 511, 7])
    ours_res = res.clone()
    ours = add_rmsnorm(x, w, 1e-6, ours_res)[0], add_rmsnorm(x, w, 1e-6)[0], *rot(pos, q, k)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)  # torch's paths
    torch_res = res.clone()
    theirs = add_rmsnorm(x, w, 1e-6, torch_res)[0], add_rmsnorm(x, w, 1e-6)[0], *rot(pos, q, k)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(ours_res, torch_res, **tol)  # the sum, written in place
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **tol)
    monkeypatch.undo()
    with pytest.raises(IndexError, match="past the table"):
        rot(torch.tensor([512, 0, 0, 0, 0]), q, k)


def q8_reference(x: torch.Tensor, planes: int | None = None) -> torch.Tensor:
    """x [M, K] as the VNNI kernels see it: per row and block of 32, q = round(x / d) with
    d = max|x| / 127 (llama.cpp's Q8 activations), and with two planes q2 = round(254 (x / d
    - q)) as well: d (q + q2 / 254). ``planes`` None: as the kernels are set now."""
    planes = planes or cpu_kernels.act_planes()
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    t = torch.where(d > 0, xb * (127 / xb.abs().amax(-1, keepdim=True)), 0)
    q = t.round()
    if planes == 2:
        q = q + ((t - q) * 254).round() / 254
    return (q * d).view(m, k)


@pytest.fixture(params=[2, 1], ids=["16-bit", "8-bit"])
def act_planes(request, monkeypatch):
    """qmm's activations in two int8 planes (the default) or one (RADIXD_CPU_ACT_BITS=8)."""
    monkeypatch.setenv(cpu_kernels.ACT_ENV, "16" if request.param == 2 else "8")
    cpu_kernels.reset()
    yield request.param
    monkeypatch.undo()
    cpu_kernels.reset()


@pytest.fixture(params=["native", "vnni"])
def int_isa(request, monkeypatch):
    """qmm as this CPU runs it (AMX tiles at 3 rows and more where it has AMX-INT8) and with AMX
    kept out (``RADIXD_CPU_ISA=vnni``: what a CPU with VNNI but without AMX runs)."""
    if request.param == "vnni":
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "vnni")
        cpu_kernels.reset()
        assert not cpu_kernels.amx()
    yield request.param
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    cpu_kernels.reset()


def random_q(bits: int, n: int, k: int, g: torch.Generator):
    """A q4 (w = d * q + m) or q8 (w = d * (u - 128)) weight: (q, d, m or None, float w)."""
    if bits == 4:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        m = (-torch.rand(n, k // 32, generator=g) * 0.8).half().float()
        return q, d, m, q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    return q, d, None, (q.float() - 128) * d.repeat_interleave(32, 1)


def q8_rows(rec: torch.Tensor, w: torch.Tensor, bits: int, g: torch.Generator, rows: tuple[int, ...]):
    """``qmm`` of random activations (a block of zeros in row 0: d = 0) at each row count, in
    float32 and bf16, shape and dtype checked: yields (x, the output, the q8 reference's
    output as the kernels are set now, its largest value)."""
    n, k = w.shape
    for rows_ in rows:
        x = torch.randn(rows_, k, generator=g)
        x[0, :32] = 0
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got = cpu_kernels.qmm(xd, rec, bits, n, k)
            assert got.shape == (rows_, n) and got.dtype == dtype
            want = q8_reference(xd) @ w.t()
            yield xd, got, want, want.abs().max().item()


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (96, 160), (301, 576)])
def test_vnni_matmul_matches_a_float_reference(bits, n, k, act_planes, int_isa):
    g = torch.Generator().manual_seed(bits * n + k)
    q, d, m, w = random_q(bits, n, k, g)
    rec = pack_records(q, d, m)
    assert rec.shape == ((n + 15) // 16, k // 32, 320 if bits == 4 else 544)
    for xd, got, want, scale in q8_rows(rec, w, bits, g, (*range(1, 17), 20)):  # (8 rows a pass)
        # the same quantized activations: int32 sums exact, float32 scaling; an activation
        # rounding the other way at a .5 tie moves a sum by one step; bf16 output rounding
        tol = 1e-4 if xd.dtype == torch.float32 else 2**-8
        torch.testing.assert_close(got.float(), want, atol=tol * scale, rtol=0)
        # against the float product: one plane costs about 1/254 of a block's largest value,
        # two about 1/254 of that
        exact = xd.float() @ w.t()
        plane_tol = 2e-2 if act_planes == 1 else 2e-4
        torch.testing.assert_close(got.float(), exact, atol=max(plane_tol, tol) * scale, rtol=0)
    gate_up = torch.randn(5, 2 * k, generator=g).to(torch.bfloat16)  # SiLU(gate) * up in the kernel
    h = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
    torch.testing.assert_close(cpu_kernels.qmm(gate_up, rec, bits, n, k, silu=True).float(), q8_reference(h) @ w.t(),
                               atol=2**-8 * (h @ w.t()).abs().max().item(), rtol=0)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up).float(), h, atol=0, rtol=2**-8)  # (prefill's)
    dense = cpu_kernels.qdequant_bf16(rec, bits, n, k)  # [k, n], for prefill's GEMM
    torch.testing.assert_close(dense.float(), w.t(), atol=0, rtol=2**-8)
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.qmm(torch.randn(2, k + 32), rec, bits, n, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (301, 576), (40, 4096)])
def test_avx2_matmul_matches_the_float_product(bits, n, k, avx2):
    """The FMA kernel multiplies the dequantized weight in float32: within float32's rounding
    of the float product at every row count (up to 8 rows dequantized in registers, more
    through the column group's panel, 6 rows at a time, in row blocks: at K 4096 blocks of 24
    rows; 25 rows there: blocks of 18 and 7), odd column counts, both dtypes, SiLU(gate) * up."""
    g = torch.Generator().manual_seed(bits * n + k)
    q, d, m, w = random_q(bits, n, k, g)
    rec = pack_records(q, d, m)
    for rows_ in (*range(1, 14), 20, 25, 70):
        x = torch.randn(rows_, k, generator=g)
        want = x.double() @ w.double().t()
        scale = want.abs().max().item()
        got = cpu_kernels.qmm(x, rec, bits, n, k)
        assert got.shape == (rows_, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=0)
        got16 = cpu_kernels.qmm(x.to(torch.bfloat16), rec, bits, n, k)  # bf16 in and out
        want16 = x.to(torch.bfloat16).double() @ w.double().t()
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.double(), want16, atol=2**-8 * scale, rtol=0)
    gate_up = torch.randn(9, 2 * k, generator=g)
    h = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    want = h.double() @ w.double().t()
    torch.testing.assert_close(cpu_kernels.qmm(gate_up, rec, bits, n, k, silu=True).double(), want,
                               atol=1e-5 * want.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.qmm(torch.randn(2, k + 32), rec, bits, n, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (96, 160), (301, 576)])
def test_avx2_one_plane_matmul_matches_the_q8_reference(bits, n, k, avx2, monkeypatch):
    """RADIXD_CPU_ACT_BITS=8 on an AVX2 CPU: the activations quantized per row and block of 32
    as the VNNI kernels quantize them (one plane), the integer dot products exact (vpmaddubsw /
    vpmaddwd), float32 scaling: within the q8 reference's float rounding at every row count
    (8 rows a pass), both dtypes, SiLU(gate) * up; about 1/254 of a block's largest value from
    the float product."""
    monkeypatch.setenv(cpu_kernels.ACT_ENV, "8")
    cpu_kernels.reset()
    assert cpu_kernels.act_planes() == 1
    g = torch.Generator().manual_seed(bits * n + k + 1)
    q, d, m, w = random_q(bits, n, k, g)
    rec = pack_records(q, d, m)
    for xd, got, want, scale in q8_rows(rec, w, bits, g, (*range(1, 17), 20, 70)):
        # float32 scaling; an activation at a .5 tie (to the last bit) may round the other
        # way than torch's: one activation step times a weight (seen: -91.5 + 1 ulp)
        step = xd.float().abs().max().item() / 127 * w.abs().max().item()
        tol = 1e-4 * scale if xd.dtype == torch.float32 else 2**-8 * scale
        torch.testing.assert_close(got.float(), want, atol=max(tol, 1.01 * step), rtol=0)
        torch.testing.assert_close(got.float(), xd.float() @ w.t(), atol=2e-2 * scale, rtol=0)
    gate_up = torch.randn(5, 2 * k, generator=g)
    h = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    want = q8_reference(h, 1) @ w.t()
    torch.testing.assert_close(cpu_kernels.qmm(gate_up, rec, bits, n, k, silu=True), want,
                               atol=1e-4 * want.abs().max().item(), rtol=0)
    # exact where the activations are whole numbers up to 127 (d = 1: no rounding at all)
    xi = torch.randint(-127, 128, (9, k), generator=g).float()
    xi[:, ::32] = 127
    want = xi.double() @ w.double().t()
    torch.testing.assert_close(cpu_kernels.qmm(xi, rec, bits, n, k).double(), want,
                               atol=1e-6 * want.abs().max().item(), rtol=0)


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(301, 576), (48, 64)])
def test_amx_matmul_equals_the_vnni_kernel_bit_for_bit(bits, n, k, act_planes):
    """The tiles' int32 sums are the VNNI kernel's, scaled by the same float operations in the
    same order: equal outputs at every row count (the tiles take 3 and more, in chunks of 8
    whose activations lie apart from the VNNI kernel's layout; 1-2 stay on VNNI), column counts
    not a multiple of the three groups a tile pass takes, both output dtypes and SiLU(gate) * up
    inputs."""
    lib = cpu_kernels.library()
    g = torch.Generator().manual_seed(bits + n)
    q, d, m, _ = random_q(bits, n, k, g)
    rec = pack_records(q, d, m)
    before = cpu_kernels.thread_stats()["amx_units"]
    try:
        for rows_ in (*range(1, 12), 16, 17, 23):
            for dtype in (torch.float32, torch.bfloat16):
                for silu in (False, True):
                    x = torch.randn(rows_, 2 * k if silu else k, generator=g).to(dtype)
                    x[0, :32] = 0
                    got = {}
                    for on in (1, 0):
                        assert lib.set_amx(on) == on
                        got[on] = cpu_kernels.qmm(x, rec, bits, n, k, silu=silu)
                    assert torch.equal(got[1], got[0]) and got[1].isfinite().all()
    finally:
        lib.set_amx(1)
    assert cpu_kernels.thread_stats()["amx_units"] > before  # (the tiles did run)


def test_amx_is_chosen_at_run_time():
    """``amx`` holds only where the CPU has AMX-INT8 (and VNNI), and ``RADIXD_CPU_ISA`` keeps it out."""
    lib = cpu_kernels.library()
    assert cpu_kernels.amx() == bool(lib is not None and cpu_kernels.vnni() and lib.amx_supported())
    for isa in ("vnni", "avx2", "baseline"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_kernels.ISA_ENV, isa)
            cpu_kernels.reset()
            assert not cpu_kernels.amx()
    cpu_kernels.reset()


@needs_vnni
@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 32, False), (4, 64, False), (4, 128, True), (8, 32, True)])
def test_packed_linear_takes_vnni_and_its_rows_and_many_rows_agree(bits, group, symmetric):
    from radixd.core.quant.ops import dequantize_int, quantize_int

    g = torch.Generator().manual_seed(group)
    n, k = 80, 256
    wf = torch.randn(n, k, generator=g)
    qw, s, z = quantize_int(wf, bits, group, symmetric)
    w = pack_cpu(qw, s, z, bits, group)
    assert w.kind == "records" and w.q.dtype == torch.uint8
    dense = dequantize_int(qw, s, z, bits, group)
    x = torch.randn(GEMM_ROWS + 3, k, generator=g).to(torch.bfloat16)
    few = torch.cat([cpu_int_linear(x[i : i + GEMM_ROWS], w) for i in range(0, x.shape[0], GEMM_ROWS)])
    many = cpu_int_linear(x, w)  # int4: dequantized + bf16 GEMM; int8: the kernel
    scale = (x.float() @ dense.t()).abs().max().item()
    torch.testing.assert_close(few.float(), q8_reference(x) @ dense.t(), atol=2**-7 * scale, rtol=0)
    torch.testing.assert_close(many.float(), x.float() @ dense.t(), atol=2e-2 * scale, rtol=0)
    if bits == 8:  # an int8 table's rows (an embedding lookup) read back from the records
        ids = torch.tensor([[0, 79, 17], [16, 15, 64]])
        torch.testing.assert_close(rows(w, ids, torch.float32), dense[ids], atol=0, rtol=2**-11)  # (fp16 scales)


def test_without_vnni_weights_are_packed_for_torchs_kernels(baseline):
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8, generator=g)
    s = torch.rand(48, 2, generator=g)
    assert not cpu_kernels.vnni() and not cpu_kernels.bf16dp()
    w4 = pack_cpu(pack_int4(q), s, torch.full_like(s, 8.0), 4, 32)
    w8 = pack_cpu(q + 100, s, None, 8, 32)
    assert (w4.kind, w8.kind) == ("torch", "torch") and w8.q.dtype == torch.int8
    x = torch.randn(3, 64, generator=g)
    dense = (q.float() - 8) * s.repeat_interleave(32, 1)
    want = x @ dense.t()
    torch.testing.assert_close(cpu_int_linear(x, w4), want, atol=2**-7 * want.abs().max().item(), rtol=0)  # (bf16)


@needs_vnni
def test_scales_fp16_cannot_hold_keep_torchs_packing():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    tiny = torch.full((32, 2), 1e-6)  # below fp16's normal range
    assert pack_cpu(pack_int4(q), tiny, torch.full_like(tiny, 8.0), 4, 32).kind == "torch"
    assert pack_cpu(pack_int4(q), tiny * 1e4, torch.full_like(tiny, 8.0), 4, 32).kind == "records"


@pytest.fixture(params=["bf16", "f32"])
def fused_dtype(request):
    """The fused decode step's two kernels: bf16 (a CPU with AVX512-VNNI and AVX512-BF16) and
    float32 (AVX2's, forced by ``RADIXD_CPU_ISA=avx2`` on any CPU with AVX2)."""
    if request.param == "bf16":
        if not (cpu_kernels.vnni() and cpu_kernels.bf16dp()):
            pytest.skip("this CPU has no AVX512-VNNI / AVX512-BF16")
        return torch.bfloat16
    request.getfixturevalue("avx2")
    return torch.float32


def _tiny_int_llama(rows: int, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None):
    """A random 2-layer Llama (head_dim 32) with int4 projections packed for the CPU, a pool
    (of ``kv_dtype``; None: the model's) and a decode step of ``rows`` requests (cpu_decode's
    contract), in ``dtype``."""
    from benchmarks.cpu_decode import decode_batch
    from radixd.core.attention import make_backend
    from radixd.core.kv_pool import KVPool
    from radixd.core.kv_quant import KVFormat
    from radixd.core.models.config import ModelConfig
    from radixd.core.models.llama import LlamaForCausalLM
    from radixd.core.quant.formats import IntLayout
    from radixd.core.quant.linear import pack_cpu_projections, quantize_projections

    torch.manual_seed(0)
    cfg = ModelConfig(architecture="LlamaForCausalLM", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=96, vocab_size=100, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
                      eos_token_ids=(2,))
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model = model.to(dtype)
    model.rotary = model.make_rotary(cfg)  # (float32 tables, as the loader rebuilds them)
    quantize_projections(model, IntLayout(4, 32, symmetric=False))
    assert pack_cpu_projections(model) == 8
    ctx = 40
    pool = KVPool(num_layers=2, num_slots=rows * (ctx + 1) + 34, num_kv_heads=2, head_dim=32, max_rows=rows,
                  max_context_len=ctx + 1, dtype=dtype, device=torch.device("cpu"),
                  kv_format=KVFormat(kv_dtype) if kv_dtype is not None else None)
    attn = make_backend("torch", pool, num_heads=4, head_dim=32, scale=32**-0.5)
    return model, pool, attn, decode_batch(pool, cfg, "shared", rows, ctx, 32, 0)


@pytest.mark.parametrize("act_bits", ["16", "8"])
@pytest.mark.parametrize("kv", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 19])
def test_fused_decode_layers_equal_the_layer_loop(rows, kv, act_bits, fused_dtype, monkeypatch):
    """(``kv``: the pool's dtype, None the model's; a float32 step's 16-bit pool has its new
    K/V rounded as torch's ``to`` rounds and is read as the layer loop's kernel reads it;
    ``act_bits`` 8: the activations in one int8 plane, RADIXD_CPU_ACT_BITS=8)"""
    from radixd.core import cpu_decode

    if kv is not None and fused_dtype != torch.float32:
        pytest.skip("a 16-bit pool under another dtype: float32 steps only")
    if act_bits == "8" and kv is not None:
        pytest.skip("(one plane with the model's pool is enough)")
    monkeypatch.setenv(cpu_kernels.ACT_ENV, act_bits)
    cpu_kernels.reset()
    assert cpu_kernels.act_planes() == (1 if act_bits == "8" else 2)
    model, pool, attn, fb = _tiny_int_llama(rows, fused_dtype, kv_dtype=kv)
    assert pool.k_buffers[0].dtype == (kv or fused_dtype)
    calls = []
    run = cpu_decode._run
    monkeypatch.setattr(cpu_decode, "_run", lambda *a: calls.append(1) or run(*a))
    got = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(cpu_decode.ENV, mode)
        for k in pool.k_buffers + pool.v_buffers:
            k[fb.out_cache_loc] = 0
        with torch.inference_mode():
            attn.begin(fb)
            assert attn.decode_all and attn.decode_lens is not None  # (the C kernel's path, not torch's)
            logits = model(fb.input_ids, fb.positions, attn, fb.logits_indices())
        got[mode] = logits, [b[fb.out_cache_loc].clone() for b in pool.k_buffers + pool.v_buffers]
    assert calls == [1]  # the fused path ran once, with "on"
    assert torch.equal(got["on"][0], got["off"][0])  # the same kernels in the same order: bit for bit
    for a, b in zip(got["on"][1], got["off"][1], strict=True):
        assert torch.equal(a, b) and a.float().abs().sum() > 0  # the new tokens' K and V, stored alike
    with pytest.raises(IndexError, match="past the table"):
        with torch.inference_mode():
            attn.begin(fb)
            model(fb.input_ids, torch.full_like(fb.positions, 256), attn, fb.logits_indices())


def _mixed_prefix_batch(pool, cfg, rows: int):
    """A decode step whose requests share three prefixes of 16 slots (every fifth request
    none), at contexts of 20..40 tokens: the fused kernel's groups of members."""
    from radixd.core.forward_batch import ForwardBatch

    table = pool.req_to_token
    prefixes = [torch.arange(1 + 16 * p, 17 + 16 * p) for p in range(3)]
    slot, ctx = 49, []
    for b in range(rows):
        c = 20 + (5 * b) % 21
        own = c + 1 - (0 if b % 5 == 4 else 16)
        mine = torch.arange(slot, slot + own)
        table[b, : c + 1] = mine if b % 5 == 4 else torch.cat((prefixes[b % 3], mine))
        slot += own
        ctx.append(c)
    assert slot <= pool.k_buffers[0].shape[0]
    gen = torch.Generator().manual_seed(1)
    for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    ids = list(range(rows))
    return ForwardBatch(input_ids=torch.randint(0, cfg.vocab_size, (rows,), generator=gen),
                        positions=torch.tensor(ctx), out_cache_loc=table[torch.arange(rows), torch.tensor(ctx)].clone(),
                        rows=ids, prefix_lens=ctx, extend_lens=[1] * rows, sample_indices=ids)


@pytest.mark.parametrize("rows", [2, 7, 13])
def test_fused_decode_groups_requests_sharing_a_prefix_bit_for_bit(rows, fused_dtype, monkeypatch):
    """Requests whose rows share a prefix attend as members of one unit (bf16: at most four a
    unit; float32 attends per request and KV head), at different lengths, beside requests
    alone: the same logits as the layer loop, which attends to each request by itself."""
    from radixd.core import cpu_decode

    model, pool, attn, _ = _tiny_int_llama(rows, fused_dtype)
    fb = _mixed_prefix_batch(pool, model.cfg, rows)
    got = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(cpu_decode.ENV, mode)
        with torch.inference_mode():
            attn.begin(fb)
            assert attn.decode_all
            got[mode] = model(fb.input_ids, fb.positions, attn, fb.logits_indices())
    assert torch.equal(got["on"], got["off"]) and got["on"].isfinite().all()
    with torch.inference_mode():  # and the grouping changes nothing but the order of work
        for b in range(rows):  # no two rows start alike: requests alone, the same KV values
            first, fresh = int(pool.req_to_token[b, 0]), pool.k_buffers[0].shape[0] - 1 - b
            assert not (pool.req_to_token[:rows] == fresh).any()
            for buf in pool.k_buffers + pool.v_buffers:
                buf[fresh] = buf[first]
            pool.req_to_token[b, 0] = fresh
        attn.begin(fb)
        alone = model(fb.input_ids, fb.positions, attn, fb.logits_indices())
    assert torch.equal(alone, got["on"])


def test_fused_decode_declines_what_it_does_not_serve(baseline):
    from radixd.core import cpu_decode

    model, _, attn, fb = _tiny_int_llama(2)  # (baseline: torch's int4 packing, no VNNI records)
    attn.begin(fb)
    assert cpu_decode.runner(model, attn, torch.zeros(2, 128, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("delay_us", [0, 300])
def test_two_threads_give_one_threads_results(delay_us, fused_dtype):
    """The helper thread's units equal the caller's bit for bit, in the int matmuls, decode
    attention and the fused decode step; with the helper held up in every unit (as if
    preempted) the caller takes its units back and the results are still the same."""
    from radixd.core import cpu_decode

    lib = cpu_kernels.library()
    g = torch.Generator().manual_seed(11)
    q, d, m, _ = random_q(4, 1000, 256, g)
    rec = pack_records(q, d, m)
    x = torch.randn(8, 256, generator=g).to(fused_dtype)
    model, pool, attn, fb = _tiny_int_llama(6, fused_dtype)
    kv = torch.randn(2, 300, 2, 64, generator=g).to(fused_dtype)
    qa = torch.randn(6, 8, 64, generator=g).to(fused_dtype)
    slots = torch.randint(0, 300, (6, 90), generator=g)
    lens = torch.tensor([1, 90, 45, 7, 64, 33])

    q2, d2, m2, _ = random_q(8, 100, 4096, g)  # (many rows at a long K: row blocks x column ranges)
    rec2, x2 = pack_records(q2, d2, None), torch.randn(100, 4096, generator=g).to(fused_dtype)

    def run():
        with torch.inference_mode():
            attn.begin(fb)
            logits = model(fb.input_ids, fb.positions, attn, fb.logits_indices())
        out = (cpu_kernels.qmm(x, rec, 4, 1000, 256), logits, cpu_kernels.decode(qa, kv[0], kv[1], slots, lens, 0.125),
               cpu_kernels.qmm(x2, rec2, 8, 100, 4096))
        if fused_dtype == torch.bfloat16:
            out += (cpu_kernels.qdequant_bf16(rec, 4, 1000, 256),)
        return out

    assert cpu_kernels.set_threads(1) == 1
    want = run()
    assert cpu_decode.runner(model, attn, torch.zeros(6, 128, dtype=fused_dtype)) is not None
    before = cpu_kernels.thread_stats()
    try:
        assert cpu_kernels.set_threads(2) == 2
        lib.set_helper_delay(delay_us)
        for i in range(30):
            got = run()
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            # calls of other shapes between (a late helper then reads buffers laid out anew)
            assert torch.equal(cpu_kernels.qmm(x[: 1 + i % 8], rec, 4, 1000, 256), want[0][: 1 + i % 8])
    finally:
        lib.set_helper_delay(0)
        cpu_kernels.set_threads(1)
    after = cpu_kernels.thread_stats()
    if delay_us:  # every unit the helper took was taken back
        assert after["stolen"] > before["stolen"]
    else:
        assert after["helper_units"] > before["helper_units"]
