"""A CPU decode step's decoder layers in one call of radixd's C kernels
(``cpu_kernels.c``: ``decode_layers_bf16``, ``decode_layers_f32``), where the layer-by-layer
path would spend more time in Python and in torch's per-op overhead than in the kernels
themselves (about 40 small operations a layer, 30 layers: 8-10 ms of a 20-40 ms step of the
default model on an AVX512 CPU; about 20 ms of a 70-80 ms one on a 2-core AVX2 CPU, where
the helper thread also slept between the kernels' calls and woke late for each).

``runner(model, attn, x)`` returns a callable that runs every layer of ``model`` on the
step's embeddings ``x`` at ``positions`` and returns ``(out, residual)`` as the layer loop would (the last
layer's output and the residual stream, which the model's final norm adds), or None where the
step or the model is not one it serves; the caller then runs its layers as usual. It serves:

- a Llama-family model (``DecoderLayer`` blocks exactly: pre-norms, fused q/k/v without bias
  or q/k norms, neox rotary through ``Rotary``'s tables, a SiLU ``GatedMLP``, no tensor
  parallelism) whose four projections are "records" int weights (``cpu_int``: a GGUF served
  natively), either in bf16 on a CPU with AVX512-VNNI and AVX512-BF16 (``decode_layers_bf16``)
  or in float32 on a CPU with AVX2 (``cpu_kernels.avx2``: ``decode_layers_f32``);
- a decode step of the torch attention backend whose every token is a request's one new
  token attended through the C kernel (``TorchAttention.decode_lens``), over a pool of the
  step's dtype, or (float32 steps) a float16 / bfloat16 pool (``kv_cache_dtype``: K and V
  rounded to it as they are stored, read in float32).

The C function calls the same kernels the layer-by-layer path calls, in the same order, with
the same roundings between them: its result is that path's bit for bit (tested).

Contract: the layers' tensors (weights, norms, the pool's buffers, the rotary tables) are
read through their addresses, gathered once per (model, pool) and kept with the model; they
never move (the model's parameters are not replaced after loading; a pool's buffers are
allocated once). ``RADIXD_CPU_FUSED=off`` turns this path off (the layer loop runs).
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor

from radixd.core import cpu_kernels

ENV = "RADIXD_CPU_FUSED"
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", P), ("o", P), ("gate_up", P), ("down", P), ("qkv_bits", I64), ("o_bits", I64),
                ("gate_up_bits", I64), ("down_bits", I64), ("norm_in", P), ("norm_post", P), ("k_buf", P),
                ("v_buf", P), ("eps_in", F32), ("eps_post", F32)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", I64), ("inter", I64), ("hq", I64), ("hkv", I64), ("dim", I64), ("layers", I64),
                ("max_pos", I64), ("scale", F32), ("cos", P), ("sin", P), ("kvt", I64)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", I64), ("pos", P), ("loc", P), ("slots", P), ("lens", P), ("width", I64), ("pool_slots", I64)]


class _Plan:
    """The model's layers as the C function reads them, for one pool."""

    def __init__(self, model, pool, scale: float):
        self.pool, self.key = pool, _pool_key(pool)
        first = model.layers[0]
        att, mlp = first.self_attn, first.mlp
        self.keep = []  # (tensors whose addresses the structures hold)
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            projs = [a.qkv_proj.cpu, a.o_proj.cpu, m.gate_up_proj.cpu, m.down_proj.cpu]
            norms = [layer.input_layernorm.weight.contiguous(), layer.post_attention_layernorm.weight.contiguous()]
            self.keep += [*(p.q for p in projs), *norms]
            self.layers[i] = _Layer(*(p.q.data_ptr() for p in projs), *(p.bits for p in projs),
                                    *(n.data_ptr() for n in norms), pool.k_buffers[i].data_ptr(),
                                    pool.v_buffers[i].data_ptr(), layer.input_layernorm.eps,
                                    layer.post_attention_layernorm.eps)
        rot = model.rotary
        self.model = _Model(model.cfg.hidden_size, mlp.down_proj.in_features, att.num_heads, att.num_kv_heads,
                            att.head_dim, len(model.layers), rot.cos.shape[0], scale, rot.cos.data_ptr(),
                            rot.sin.data_ptr(), cpu_kernels.kv_type(pool.model_dtype, pool.dtype))
        self.keep += [rot.cos, rot.sin]


def _pool_key(pool) -> tuple:
    return id(pool), pool.k_buffers[0].data_ptr(), len(pool.k_buffers)


_KERNELS = {torch.bfloat16: "decode_layers_bf16", torch.float32: "decode_layers_f32"}


def _kernel(model) -> str | None:
    """The C function that runs ``model``'s decode steps on this CPU, or None."""
    if cpu_kernels.vnni() and cpu_kernels.bf16dp() and _model_fits(model, torch.bfloat16):
        return _KERNELS[torch.bfloat16]
    if cpu_kernels.avx2() and _model_fits(model, torch.float32):
        return _KERNELS[torch.float32]
    return None


def _model_fits(model, dtype: torch.dtype) -> bool:
    from radixd.core.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, Rotary
    from radixd.core.quant.linear import QuantLinear

    if type(getattr(model, "rotary", None)) is not Rotary or not hasattr(model, "layers"):
        return False
    rot = model.rotary
    if rot.cos.dtype != torch.float32 or not (rot.cos.is_contiguous() and rot.sin.is_contiguous()):
        return False
    shapes = set()
    for layer in model.layers:
        if type(layer) is not DecoderLayer or layer.all_reduce is not None:
            return False
        a, m = layer.self_attn, layer.mlp
        if type(a) is not Attention or a.q_norm is not None or type(m) is not GatedMLP or m.gelu:
            return False
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return False
        if any(n.weight.dtype != dtype for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return False
        for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
            if not isinstance(p, QuantLinear) or p.cpu is None or p.cpu.kind != "records" or p.bias is not None:
                return False
        shapes.add((a.num_heads, a.num_kv_heads, a.head_dim, m.down_proj.in_features))
        h, kv, d, inter = a.num_heads, a.num_kv_heads, a.head_dim, m.down_proj.in_features
        if (a.qkv_proj.out_features != (h + 2 * kv) * d or m.gate_up_proj.out_features != 2 * inter
                or a.o_proj.in_features != h * d or 2 * rot.cos.shape[1] != d):
            return False
    if len(shapes) != 1:
        return False
    heads, kv_heads, dim, inter = next(iter(shapes))
    if dtype == torch.bfloat16:
        return cpu_kernels.fused_attention_takes(heads, kv_heads, dim)
    return (heads % kv_heads == 0 and heads // kv_heads <= cpu_kernels.MAX_GROUP and dim <= cpu_kernels.MAX_DIM
            and dim % 2 == 0 and (heads * dim) % 32 == 0 and inter % 32 == 0 and model.cfg.hidden_size % 32 == 0)


def runner(model, attn, x: Tensor):
    """The step's layers in one C call (module docstring), or None."""
    from radixd.core.attention.torch_backend import TorchAttention

    if x.device.type != "cpu" or type(attn) is not TorchAttention:
        return None
    if not attn.decode_all or os.environ.get(ENV, "").lower() in ("off", "0", "false"):
        return None
    kernel = getattr(model, "_cpu_fused_kernel", False)
    if kernel is False:
        kernel = model._cpu_fused_kernel = _kernel(model)
    pool = attn.pool
    # (decode_all: the C decode kernel takes this pool under the model's dtype, a 16-bit pool
    # under float32 included, which only decode_layers_f32 is then given)
    if kernel is None or _KERNELS.get(x.dtype) != kernel or pool.quantized:
        return None
    if any(attn.windows) or attn.softcap:
        return None
    plan = getattr(model, "_cpu_fused_plan", None)
    if plan is None or plan.key != _pool_key(pool) or plan.pool is not pool:
        if not all(b.is_contiguous() for b in (*pool.k_buffers, *pool.v_buffers)):
            return None
        plan = model._cpu_fused_plan = _Plan(model, pool, attn.scale)
    return lambda emb, positions: _run(plan, attn, emb, positions, kernel)


def _run(plan: _Plan, attn, x: Tensor, positions: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows = x.shape[0]
    slots, lens = attn.decode_kv_idx.contiguous(), attn.decode_lens
    pos, loc = positions.to(torch.int64).contiguous(), attn.out_cache_loc.to(torch.int64).contiguous()
    if not (slots.dtype == lens.dtype == torch.int64 and pos.shape[0] == loc.shape[0] == lens.shape[0] == rows):
        raise ValueError("cpu_decode: the step's positions, slots and tables disagree")
    out = torch.empty_like(x)
    step = _Step(rows, pos.data_ptr(), loc.data_ptr(), slots.data_ptr(), lens.data_ptr(), slots.shape[1],
                 attn.pool.k_buffers[0].shape[0])
    rc = getattr(cpu_kernels.library(), kernel)(ctypes.byref(plan.model), plan.layers, ctypes.byref(step), x.data_ptr(),
                                                 out.data_ptr())
    if rc == -3:
        raise IndexError(f"rotary: a position past the table's {plan.model.max_pos}")
    if rc == -4:
        raise IndexError("cpu_decode: a KV slot outside the pool, or a length outside the table")
    if rc:
        raise RuntimeError(f"cpu_kernels.{kernel} failed ({rc})")
    return out, x
