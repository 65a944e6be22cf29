"""radixd's C kernels for the CPU (``cpu_kernels.c``): built from source with the machine's C
compiler on first use, kept in radixd's cache, called through ``ctypes``.

- ``decode``: decode attention. A small problem per request (one query row, a few hundred
  keys), for which torch's attention kernels pay more in setting up each call than in
  arithmetic; this reads every request's keys and values through its slots in the pool, all
  requests of a layer in one call. Over a bf16 pool on a CPU with AVX512-BF16 (``bf16dp``)
  the scores are ``vdpbf16ps`` dot products, four keys reduced at once, and the slots are read
  in tiles of 32, every head of a slot together; on a CPU with AMX-BF16 (``amx``) the scores
  come from tiles instead, 16 keys by the query heads of every request sharing them (a
  radix-cached prefix's keys read once for all), 5% off a decode step of 8 requests on one
  512-token prefix.
- ``add_rmsnorm`` and ``rotary``: a layer's small elementwise steps in one call each, where
  torch's path costs 25-50 us of op overhead a call (a decode step makes 90 of them).
- ``qmm`` (AVX512-VNNI, ``vnni``): x @ W.T for int4 / int8 weights in ``cpu_int``'s records,
  the activations quantized per block of 32 into two int8 planes (about 15 bits; one with
  ``RADIXD_CPU_ACT_BITS=8``: llama.cpp's Q8), ``vpdpbusd`` dot products, each weight vector
  loaded once for all rows; SiLU(gate) * up formed while quantizing the down projection's
  input. At 3 rows and more on a CPU with AMX-INT8 (``amx``) each block's int32 sums come
  from a ``tdpbsud`` tile product instead (8 rows' two planes in one tile, three column groups
  per activation tile), scaled as the VNNI kernel scales them: the same results bit for bit,
  0.65-0.7x its time at 8 and 16 rows (a decode step's matmuls). ``qdequant_bf16``: such a
  weight in bf16 for prefill's GEMMs. ``decode_layers_bf16``: a whole decode step's decoder
  layers in one call (``cpu_decode``).
- ``qmm`` (AVX2, FMA and F16C without AVX512-VNNI, ``avx2``): the same records times float32
  activations, the weights dequantized inside the kernel: up to 8 rows in registers (8 rows
  by 8 columns a pass), more through a float panel of the column group (a 6 x 16 register
  tile) in row blocks whose activations stay in the L2 cache. Few rows sum a block's
  products of the integers and scale the sum (d sum x q + m sum x), without dequantizing each
  weight. On a 2-core AMD EPYC at 8 rows 109-133 GFLOP/s on the default model's shapes
  (torch's int4 kernel on bf16 activations took twice as long), at 256-2176 rows 150-175 (float32's GEMM 114-130; without the row blocks
  100-125 at 544 rows and more). ``decode_layers_f32``: the fused decode step in float32 on these kernels.
  With ``RADIXD_CPU_ACT_BITS=8`` the activations are quantized as the VNNI kernel's one plane
  (llama.cpp's Q8) and the products are integer (vpmaddubsw / vpmaddwd: the VNNI kernel's
  int32 sums, scaled by the same float steps in the same order): 1.6-1.9x the float kernel at 8
  rows, 2.5-3.2x at one; a decode step of one request 0.61x the time, of eight 0.72x.
- ``decode`` runs on both threads where the helper runs (``decode_mt``: a unit per request
  and KV head, KV head by KV head, so that a prefix the requests share comes from the caches
  after the first). On AVX2 a float32 pool's attention holds its sums in registers (its query
  heads three at a time, keys two at a time, values in tiles of 32 keys): on the 2-core EPYC,
  8 requests over a shared 512-token prefix, 30 layers, 10.7 -> 6.1 ms. A float32 step's
  pool may hold float16 or bfloat16 (``kv_cache_dtype``; ``kv_type``): the same kernel reads
  its rows converted to float32 (F16C, or a shift), the same arithmetic after, so half the
  bytes come from memory (8 requests over four 512-token prefixes, two threads: 8.0-8.2 ->
  6.1-7.4 ms over 30 layers).
- ``extend`` (AVX2): prompt attention, every extend of a step (a prompt, or its chunk after
  the request's cached prefix) in one call, read through its slots where they lie, float32
  queries over a pool of float32, float16 or bfloat16. A task is an extend's KV head and a
  block of its rows, whose query vectors (rows x the head's query heads, 24) sit in vector
  lanes: a block of 16 keys' scores is an outer product of broadcast key elements and the
  query lanes (12 sums in registers), the online softmax is lane-wise, and the values' sums
  likewise. On the 2-core EPYC, the default model's heads: 115-135 GFLOP/s where torch's
  SDPA over the gathered KV ran at 50-63 (a 544-token prompt 3.0 against 6.9 ms a layer;
  8 questions of 32 over a 512-token prefix 2.3 against 5.0 ms; an 8192-token prompt 1.13x;
  ``benchmarks.cpu_extend``). ``store_rows``: a step's new K/V into the pool in the calling
  thread (torch's index_put ran in its OpenMP threads beside the kernels' helper and took
  46-470 us for 96 rows where its own time was 11).
- ``int8_matmul``: x @ W.T for a grouped int8 weight (Q8_0's blocks of 32), few rows: each
  weight read once for up to 8 rows, where torch's int8 kernel takes one group per call and
  adds the partial products up in memory (an LM head of 49k rows at 8 rows: 4x). (CPUs
  without VNNI or AVX2.)
- ``int4pack_to_bf16``: an int4 weight in torch's CPU packing, dequantized for a matmul of
  many rows (prefill), where a bf16 GEMM runs 2-3x faster than torch's int4 kernel; decode
  steps keep the int4 kernel, which reads a quarter of the bytes. ``int4pack_block``
  finds once which packing this torch writes (its AVX512 build's blocks of 64 rows or its AVX2
  build's of 32). (CPUs without VNNI or AVX2, or ``RADIXD_CPU_ISA=baseline``.)

Threads (``set_threads``): with 2, a helper thread shares the units of ``qmm``, of the fused
step's attention, of ``extend`` and of ``qdequant_bf16`` with the calling thread; a helper the OS preempted
has its units taken back past a deadline (``cpu_kernels.c``: the helper writes into a shadow
buffer), so that a core taken by something else costs a unit's wait, not a barrier's.

The kernels that need a CPU extension (AVX512-VNNI, AVX512-BF16) are compiled with
``target`` attributes whatever ``-march=native`` allows and called only where the CPU has
the extension (``__builtin_cpu_supports``, CPUID, at run time; AMX also needs Linux to grant
the process its tile state, ``arch_prctl``); ``RADIXD_CPU_ISA=baseline`` keeps them out,
``RADIXD_CPU_ISA=vnni`` keeps out AMX only (the tests run all three ways).

The library is compiled for this CPU
(``-march=native``), once per source, compiler and CPU (the file name carries a hash of
the three), into ``<cache>/kernels/``; several processes building it at once each write
their own file and rename it into place.

Without a C compiler (``$CC``, else ``cc``), or with ``RADIXD_CPU_KERNELS=off``, ``library()``
is None and the callers keep torch's path; why is logged once.

Contract: the kernels only read their inputs and write their results (``decode_layers_bf16``:
the residual stream in place and the step's K/V into the pool); ``takes``,
``fused_attention_takes`` and ``int4pack_readable`` say where they apply (the callers fall
back to torch elsewhere). The helper thread's buffers are grown, never freed, for the
process's life.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from radixd.core.cache_dir import cache_root

log = logging.getLogger(__name__)
_local = threading.local()  # per thread: qdequant_bf16's scratch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp-simd", "-fPIC", "-pthread")  # compile only: see _build
ENV = "RADIXD_CPU_KERNELS"
ISA_ENV = "RADIXD_CPU_ISA"  # "baseline": none of the kernels that need a CPU extension; "avx2": none of AVX512's; "vnni": all but AMX
ACT_ENV = "RADIXD_CPU_ACT_BITS"  # "8": qmm's activations in one int8 plane (llama.cpp's); "16" (default): two
_FUNCS = {torch.bfloat16: "decode_bf16", torch.float32: "decode_f32"}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_GROUP, MAX_DIM = 16, 256  # (cpu_kernels.c: MAX_G, MAX_D): query heads per KV head, head_dim
_DP_MAX_HD = 8192  # (cpu_kernels.c: DP_MAX_HD) query heads x head_dim of decode_bf16_dp


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        part = Path(tmp.name)
    obj = part.with_suffix(".o")
    # Compiled with -ffast-math, linked without it: linking a library with it adds gcc's
    # crtfastmath, which on load sets flush-to-zero for the whole process (every float op of
    # torch and numpy after it would lose subnormals).
    try:
        for cmd in ([cc, *FLAGS, "-c", "-o", str(obj), str(SOURCE)], [cc, "-shared", "-pthread", "-o", str(part), str(obj), "-lm"]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{cc} exited with {done.returncode}: {done.stderr.strip()[-1500:]}")
        part.rename(target)
    finally:
        part.unlink(missing_ok=True)
        obj.unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built now if need be), or None: see the module docstring."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "false"):
        log.info("CPU kernels off (%s): decode attention runs through torch", ENV)
        return None
    cc = os.environ.get("CC") or shutil.which("cc")
    if not cc:
        log.warning("no C compiler (cc, or $CC): decode attention on the CPU runs through torch, slower")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_key()]).encode())
    target = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _build(cc, target)
        except (OSError, RuntimeError) as e:
            log.warning("building the CPU kernels failed, decode attention runs through torch: %s", e)
            return None
    lib = ctypes.CDLL(str(target))
    for name in (*_FUNCS.values(), "decode_bf16_dp"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_void_p]
    lib.decode_mt.restype = ctypes.c_int
    lib.decode_mt.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
                              + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int])
    lib.extend_mt.restype = ctypes.c_int
    lib.extend_mt.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2
                              + [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_float])
    lib.kv_store_rows.restype = ctypes.c_int
    lib.kv_store_rows.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                                  + [ctypes.c_int64] * 2 + [ctypes.c_int])
    for name in ("add_rmsnorm_bf16", "add_rmsnorm_f32"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                                       + [ctypes.c_int64] * 3 + [ctypes.c_float])
    for name in ("rotary_bf16", "rotary_f32"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4
    lib.int8g_mm.restype = ctypes.c_int
    lib.int8g_mm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    lib.int4pack_to_bf16_t.restype = None
    lib.int4pack_to_bf16_t.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    for name in ("vnni_supported", "bf16dp_supported", "avx2_supported"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    for name in ("qmm_vnni", "qmm_fma"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = ([ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4)
    lib.set_act_planes.restype = ctypes.c_int
    lib.set_act_planes.argtypes = [ctypes.c_int]
    lib.set_act_planes(act_planes())
    lib.amx_supported.restype = lib.set_amx.restype = ctypes.c_int
    lib.amx_supported.argtypes = []
    lib.set_amx.argtypes = [ctypes.c_int]
    isa = os.environ.get(ISA_ENV, "").lower()
    lib.set_amx(int(isa not in ("baseline", "avx2", "vnni") and lib.vnni_supported() and lib.amx_supported()))
    lib.set_threads.restype = ctypes.c_int
    lib.set_threads.argtypes = [ctypes.c_int]
    lib.set_helper_delay.restype = None
    lib.set_helper_delay.argtypes = [ctypes.c_int]
    lib.thread_stats.restype = None
    lib.thread_stats.argtypes = [ctypes.c_void_p]
    for name in ("decode_layers_bf16", "decode_layers_f32"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 5
    lib.silu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.qdequant_bf16_t.restype = None
    lib.qdequant_bf16_t.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
    return lib


def act_planes() -> int:
    """int8 planes of ``qmm``'s activations: 2 (about 15 bits: the products' results stay within
    bf16 activations' distance of float32's), or 1 with ``RADIXD_CPU_ACT_BITS=8`` (llama.cpp's
    Q8 activations: faster at 8 rows and more, coarser)."""
    value = os.environ.get(ACT_ENV, "16")
    if value not in ("8", "16"):
        raise ValueError(f"{ACT_ENV}={value!r}: expected 8 or 16")
    return 1 if value == "8" else 2


def _extension(probe: str) -> bool:
    lib = library()
    isa = os.environ.get(ISA_ENV, "").lower()
    if lib is None or isa == "baseline" or (isa == "avx2" and probe != "avx2_supported"):
        return False
    return bool(getattr(lib, probe)())


@functools.cache
def vnni() -> bool:
    """Whether the integer dot-product kernels (``qmm``) run here: the library is built, this
    CPU has AVX512-VNNI (checked at run time, whatever the compiler targeted) and
    ``RADIXD_CPU_ISA`` is not ``baseline``."""
    return _extension("vnni_supported")


def amx() -> bool:
    """Whether ``qmm`` multiplies 3 rows and more on AMX-INT8 tiles (the same results as its
    VNNI kernel, bit for bit): ``vnni()`` holds, the CPU has AMX-INT8, Linux gave the process
    the tiles' state, and ``RADIXD_CPU_ISA`` is neither ``baseline`` nor ``vnni``. Decided when
    the library loads (``reset`` reads the environment again)."""
    lib = library()
    return lib is not None and bool(lib.set_amx(-1))


@functools.cache
def avx2() -> bool:
    """Whether ``qmm`` runs its AVX2 kernel here (a CPU with AVX2, FMA and F16C, where
    ``vnni()`` does not hold): float32 activations, the weights dequantized in the kernel."""
    return not vnni() and _extension("avx2_supported")


def records() -> bool:
    """Whether int weights are packed into ``qmm``'s records (``cpu_int``): ``vnni()`` or
    ``avx2()``."""
    return vnni() or avx2()


@functools.cache
def bf16dp() -> bool:
    """Whether decode attention over a bf16 pool takes its AVX512-BF16 kernel (as ``vnni``)."""
    return _extension("bf16dp_supported")


def qmm(x: Tensor, w: Tensor, bits: int, n: int, k: int, *, silu: bool = False) -> Tensor:
    """``x`` [M, K] (float32 or bf16) times the repacked ``bits`` weight ``w`` (``cpu_int``'s
    q4 / q8 records) transposed: [M, n] in x's dtype. ``silu``: x is [M, 2K] (gate | up) and
    the rows multiplied are SiLU(gate) * up."""
    lib = library()
    assert lib is not None and x.dtype in _SUFFIX and x.stride(-1) == 1 and w.dtype == torch.uint8
    rows = x.shape[0]
    if x.shape[1] != (2 * k if silu else k):
        raise ValueError(f"qmm: x has {x.shape[1]} columns, the weight {k}{' (x2: SiLU)' * silu}")
    y = torch.empty((rows, n), dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    rc = (lib.qmm_vnni if vnni() else lib.qmm_fma)(bits, x.data_ptr(), bf16, x.stride(0), int(silu), w.data_ptr(), y.data_ptr(), bf16, n, rows, n, k)
    if rc == -1:
        raise ValueError(f"cpu_kernels.qmm: {rows} rows, K {k}, {bits} bits: wants rows >= 1, K a multiple of 32, 4 or 8 bits")
    if rc:
        raise MemoryError(f"cpu_kernels.qmm: no memory for {rows} x {k} activations (rc {rc})")
    return y


def silu_mul(x: Tensor) -> Tensor:
    """SiLU(gate) * up of a bf16 x [M, 2K] (gate | up, last dimension contiguous): [M, K] bf16,
    computed in float32 and rounded once."""
    lib = library()
    assert lib is not None and x.dtype == torch.bfloat16 and x.stride(-1) == 1
    rows, k = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, k), dtype=torch.bfloat16)
    lib.silu_mul_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), rows, k)
    return out


def qdequant_bf16(w: Tensor, bits: int, n: int, k: int, *, scratch: bool = False) -> Tensor:
    """The repacked ``bits`` weight ``w`` in bf16, transposed: [k, n] (on both threads where
    the kernels' helper runs), a view whose rows lie ``padded_ld(n)`` elements apart (a
    matmul reads it in place). ``scratch``: in this thread's reused buffer (valid until its
    next such call): a prefill dequantizes every weight of the model, and fresh pages for each
    (a 3.5 MB tensor, given back to the OS when freed) cost the kernel's page faults more than
    the dequantization itself."""
    lib = library()
    assert lib is not None and w.dtype == torch.uint8 and w.is_contiguous()
    ld = padded_ld(n)
    if scratch:
        buf = getattr(_local, "dense", None)
        if buf is None or buf.numel() < k * ld:
            buf = _local.dense = torch.empty(k * ld, dtype=torch.bfloat16)
        out = buf[: k * ld].view(k, ld)
    else:
        out = torch.empty((k, ld), dtype=torch.bfloat16)
    lib.qdequant_bf16_t(bits, w.data_ptr(), out.data_ptr(), n, k, ld)
    return out[:, :n]


def padded_ld(n: int) -> int:
    """Row length (bf16 elements) for n columns: whole 32-byte pieces, an odd number of them,
    so that the rows of a column fall into every cache set (``qdequant_bf16_t``; for the
    default model's gate/up weight, 3072 columns, the dequantization takes half the time and
    the GEMM reading it 0.8x)."""
    pieces = -(-n // 16)
    return 16 * (pieces + 1 - pieces % 2)


def set_threads(threads: int) -> int:
    """The kernels' threads: 2 starts (or keeps using) their helper thread, 1 stops handing it
    work (``cpu_kernels.c``: the int matmuls, the int4 dequantization and the fused decode
    step's attention); returns the threads in use (1 without the library)."""
    lib = library()
    return lib.set_threads(threads) if lib is not None else 1


def thread_stats() -> dict[str, int]:
    """Units the helper thread ran, units the calling thread took back from it (it was
    preempted), and units run on AMX tiles (``amx``: int matmuls, decode attention's scores),
    since the process started."""
    lib = library()
    if lib is None:
        return {"helper_units": 0, "stolen": 0, "amx_units": 0}
    out = (ctypes.c_int64 * 3)()
    lib.thread_stats(out)
    return {"helper_units": out[0], "stolen": out[1], "amx_units": out[2]}


def reset() -> None:
    """Forget what was probed (the library, the CPU's extensions): the environment is read
    again at the next use (tests switching ``RADIXD_CPU_ISA`` or ``RADIXD_CPU_KERNELS``)."""
    for fn in (library, vnni, avx2, bf16dp, int4pack_block):
        fn.cache_clear()


# A float32 step's pool in 16 bits (``kv_cache_dtype``): the element type the AVX2 kernels read
# (cpu_kernels.c: KV_F16, KV_BF16; 0 is a pool of the queries' dtype).
KV_TYPES = {torch.float16: 1, torch.bfloat16: 2}


def kv_type(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int | None:
    """The kernels' code for a pool of ``kv_dtype`` read by queries of ``q_dtype`` (0: the
    same dtype), or None where no kernel reads it: a 16-bit pool under float32 queries needs
    the AVX2 kernels."""
    if kv_dtype == q_dtype:
        return 0
    if q_dtype == torch.float32 and kv_dtype in KV_TYPES and _extension("avx2_supported"):
        return KV_TYPES[kv_dtype]
    return None


def takes(q_dtype: torch.dtype, k_buf: Tensor, num_heads: int) -> bool:
    """Whether ``decode`` serves queries of ``q_dtype`` over ``k_buf`` ([slots, Hkv, D]): a
    pool of their dtype, or a float32 step's 16-bit pool on an AVX2 CPU (head_dim a multiple of 8)."""
    kv_heads, dim = k_buf.shape[1], k_buf.shape[2]
    kvt = kv_type(q_dtype, k_buf.dtype) if library() is not None else None
    return (k_buf.device.type == "cpu" and kvt is not None and q_dtype in _FUNCS and k_buf.is_contiguous()
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_GROUP and dim <= MAX_DIM
            and (kvt == 0 or dim % 8 == 0))


def fused_attention_takes(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether ``decode_bf16_dp`` (the AVX512-BF16 decode attention) takes these head shapes."""
    return (heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and dim % 32 == 0 and dim <= MAX_DIM
            and heads * dim <= _DP_MAX_HD)


def decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, slots: Tensor, lens: Tensor, scale: float) -> Tensor:
    """Attention of ``q`` [B, H, D] (request b's one query) over the pool's ``k_buf``/``v_buf``
    [slots, Hkv, D] at ``slots[b, :lens[b]]`` (int64 [B, L], [B]) -> [B, H, D] (``takes``: a
    pool of q's dtype, or a float32 step's float16 / bfloat16 pool, read in float32)."""
    lib = library()
    assert lib is not None and v_buf.is_contiguous() and slots.dtype == lens.dtype == torch.int64
    q = q.contiguous()
    slots = slots.contiguous()
    b, heads, dim = q.shape
    kv_heads, width = k_buf.shape[1], slots.shape[1]
    out = torch.empty_like(q)
    dp = q.dtype == torch.bfloat16 and fused_attention_takes(heads, kv_heads, dim) and bf16dp()
    scratch = torch.empty((heads if dp else heads // kv_heads) * width, dtype=torch.float32)
    args = (q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(), b,
            heads, kv_heads, dim, width, scale, scratch.data_ptr())
    if dp:
        rc = lib.decode_bf16_dp(*args)
    else:  # (on both threads where the kernels' helper runs)
        kvt = kv_type(q.dtype, k_buf.dtype)
        assert kvt is not None and v_buf.dtype == k_buf.dtype
        rc = lib.decode_mt(int(q.dtype == torch.bfloat16), *args, k_buf.shape[0], int(_extension("avx2_supported")),
                           kvt)
    if rc:
        raise ValueError(f"cpu_kernels.decode: shape out of range (heads {heads}, KV heads {kv_heads}, head_dim {dim})")
    return out


def store_takes(x: Tensor, buf: Tensor) -> bool:
    """Whether ``store_rows`` writes ``x`` [T, Hkv, D] into the pool's ``buf``: float32 rows
    into a CPU pool of float32, or of float16 / bfloat16 on an AVX2 CPU (D a multiple of 8)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and buf.device.type == "cpu" and buf.is_contiguous()
            and x.dim() == 3 and x.shape[1:] == buf.shape[1:] and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and library() is not None and kv_type(torch.float32, buf.dtype) is not None
            and (buf.dtype == torch.float32 or x.shape[1] * x.shape[2] % 8 == 0))


def store_rows(buf: Tensor, loc: Tensor, x: Tensor) -> None:
    """``buf[loc] = x.to(buf.dtype)`` in the calling thread (``store_takes``); ``loc`` int64."""
    lib = library()
    assert lib is not None and loc.dtype == torch.int64
    loc = loc.contiguous()
    rc = lib.kv_store_rows(x.data_ptr(), x.stride(0), loc.data_ptr(), loc.numel(), buf.data_ptr(),
                           buf.shape[1] * buf.shape[2], buf.shape[0], kv_type(torch.float32, buf.dtype))
    if rc:
        raise ValueError(f"cpu_kernels.store_rows: {'a slot outside the pool' if rc == -4 else 'unsupported rows'}")


def extend_takes(q_dtype: torch.dtype, k_buf: Tensor, num_heads: int) -> bool:
    """Whether ``extend`` serves float32 queries over ``k_buf`` ([slots, Hkv, D]) on this CPU:
    what ``decode`` takes (``takes``), on the AVX2 kernels, head_dim a multiple of 8."""
    return (q_dtype == torch.float32 and takes(q_dtype, k_buf, num_heads) and _extension("avx2_supported")
            and k_buf.shape[2] % 8 == 0)


def extend(q: Tensor, k_buf: Tensor, v_buf: Tensor, slots: Tensor, meta: Tensor, scale: float, out: Tensor) -> None:
    """Attention of a step's extends into ``out`` (``extend_takes``): q and out [T, H, D]
    float32 (rows contiguous), ``meta`` int64 [E, 4] per extend (its first row in q, its rows
    e, its cached prefix p, where its p + e slots start in ``slots``), each row i attending to
    the first p + i + 1 of its slots in the pool's ``k_buf``/``v_buf`` [S, Hkv, D]."""
    lib = library()
    assert lib is not None and v_buf.dtype == k_buf.dtype and v_buf.is_contiguous()
    assert q.dtype == out.dtype == torch.float32 and k_buf.is_contiguous()
    assert slots.dtype == meta.dtype == torch.int64 and slots.is_contiguous() and meta.is_contiguous()
    t, heads, dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == dim and out.stride(2) == 1 and out.stride(1) == dim
    kvt = kv_type(q.dtype, k_buf.dtype)
    rc = lib.extend_mt(q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(), kvt, k_buf.shape[0],
                       slots.data_ptr(), slots.numel(), meta.data_ptr(), meta.shape[0], t, out.data_ptr(), out.stride(0),
                       heads, k_buf.shape[1], dim, scale)
    if rc:
        raise ValueError(f"cpu_kernels.extend: {'no memory' if rc == -2 else 'shapes or slots out of range'} (rc {rc})")


INT4PACK_BLOCKS = (64, 32)  # the rows of a block in torch's CPU int4 packing: its AVX512 build, its AVX2 build


def int4pack_to_bf16(packed: Tensor, scales: Tensor, n: int, k: int, group: int) -> Tensor:
    """The weight [n, k] of torch's CPU int4 packing ``packed`` with ``scales`` [k / group, n,
    2] bf16 (scale, zero), ``(q - 8) * scale + zero``, in bf16 and transposed: [k, n]."""
    return _int4pack_to_bf16(packed, scales, n, k, group, int4pack_block())


def _int4pack_to_bf16(packed: Tensor, scales: Tensor, n: int, k: int, group: int, block: int) -> Tensor:
    lib = library()
    assert lib is not None and block in INT4PACK_BLOCKS and n % 64 == 0 and k % group == 0
    assert scales.dtype == torch.bfloat16
    packed, scales = packed.contiguous(), scales.contiguous()  # (held: the call reads their memory)
    out = torch.empty((k, n), dtype=torch.bfloat16)
    lib.int4pack_to_bf16_t(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, group, block)
    return out


@functools.cache
def int4pack_block() -> int:
    """The rows per block of this torch's CPU int4 packing that ``int4pack_to_bf16`` reads (a
    known weight packed and read back in each layout it knows), 0 where it reads none."""
    if library() is None:
        return 0
    n, k, group = 128, 64, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    if packed.shape != (n, k // 2):
        return 0
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k // group, n, 2)
    want = q.t().to(torch.bfloat16)
    return next((b for b in INT4PACK_BLOCKS
                 if torch.equal(_int4pack_to_bf16(packed, unit, n, k, group, b), want)), 0)


def int4pack_readable() -> bool:
    """Whether ``int4pack_to_bf16`` reads this torch's packing."""
    return int4pack_block() != 0


def int8_matmul(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """``x`` [M, K] times the grouped int8 weight ``q`` [G, N, group] with ``scales`` [G, N]
    (bf16), transposed: [M, N] float32."""
    lib = library()
    assert lib is not None and scales.dtype == torch.bfloat16 and q.dtype == torch.int8
    groups, n, group = q.shape
    xf, q, scales = x.float().contiguous(), q.contiguous(), scales.contiguous()  # (held: the call reads them)
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    if lib.int8g_mm(xf.data_ptr(), q.data_ptr(), scales.data_ptr(), y.data_ptr(), x.shape[0], n, groups * group, group):
        raise ValueError(f"cpu_kernels.int8_matmul: group {group} out of range")
    return y


def rows_take(*tensors: Tensor) -> bool:
    """Whether ``add_rmsnorm`` / ``rotary`` serve these CPU tensors (one dtype, bf16 or
    float32, last dimension contiguous) and the library is there."""
    dtype = tensors[0].dtype
    return (dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1 for t in tensors)
            and library() is not None)


def add_rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> Tensor:
    """RMSNorm(x + residual) * weight for x [R, N] (rows_take checked), the sum written into
    ``residual`` [R, N] in place first; without ``residual``, RMSNorm(x) * weight."""
    lib = library()
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    weight = weight.contiguous()
    res_ptr, res_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    getattr(lib, "add_rmsnorm_" + _SUFFIX[x.dtype])(x.data_ptr(), x.stride(0), res_ptr, res_stride, weight.data_ptr(),
                                                     out.data_ptr(), n, rows, n, eps)
    return out


def rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
    """Neox rotary of x [T, H, D] (heads contiguous within a token) at ``positions`` [T]
    (int64) with the float32 tables ``cos``/``sin`` [positions, D / 2] -> a new [T, H, D]."""
    lib = library()
    t, heads, dim = x.shape
    assert x.stride(1) == dim and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    if t and int(positions.max()) >= cos.shape[0]:
        raise IndexError(f"rotary: position {int(positions.max())} past the table's {cos.shape[0]}")
    positions = positions.contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype)
    getattr(lib, "rotary_" + _SUFFIX[x.dtype])(x.data_ptr(), x.stride(0), t, heads, dim, cos.data_ptr(), sin.data_ptr(),
                                                positions.data_ptr(), out.data_ptr())
    return out
