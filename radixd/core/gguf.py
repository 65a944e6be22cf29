"""GGUF files served as shipped (``[model] gguf_weights``): the quantized tensors read
straight from the file into radixd's quantized layers, no float copy of the model made.

``prepare(gguf, target)`` writes what the rest of the engine reads from a checkpoint
directory (config.json and the tokenizer, parsed by transformers) and ``gguf.json``, naming
the file; ``source(path)`` finds that file again and ``load(...)`` fills a model from it.

ggml types: F32 / F16 / BF16 tensors load as plain weights; Q4_1 (blocks of 32: fp16 ``d``
and ``m``, 4-bit ``q``, ``w = d * q + m``) becomes the ops' int4 asymmetric group-32 layout
(``s = d``, ``z = -m / d``; a block with ``d = 0`` is all ``m``: ``q = 0, s = m, z = -1``);
Q8_0 (fp16 ``d``, int8 ``q``, ``w = d * q``) the int8 symmetric group-32 one (``q + 128``).
Scales and zeros stay float32 until ``cpu_int`` packs them. Any other type is refused by
name (``gguf_weights = "fp32"`` converts those through transformers).

Layers: the decoder projections become ``QuantLinear`` (packed for the CPU kernels); a
quantized LM head too (a tied one reads ``token_embd``); a Q8_0 embedding is a
``QuantEmbedding`` reading only the rows it looks up (a tied head shares its table), a Q4_1
one is dequantized to the model dtype (its packed form keeps no rows readable). llama.cpp's
convert script permutes the rows of ``attn_q`` / ``attn_k`` per head (rotary pairs
interleaved); they are put back in Hugging Face's order here, as transformers does.

Contract: native GGUF serving is for one CPU process (``choose``); the file is only read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from radixd.core.cache_dir import build_once, is_checkpoint
from radixd.core.config import GGUF_WEIGHTS
from radixd.core.errors import ConfigError
from radixd.core.hf_names import hf_names
from radixd.core.models.config import ModelConfig
from radixd.core.models.weights import target_module
from radixd.core.quant.formats import IntLayout, QuantFormatError
from radixd.core.quant.linear import (
    QuantEmbedding,
    QuantLinear,
    keep_cpu_prefill_copies,
    pack_cpu_projections,
    swap_projections,
)
from radixd.core.quant.ops import dequantize_int, pack_int4

log = logging.getLogger(__name__)
SOURCE = "gguf.json"
ARCHITECTURES = ("llama",)
FLOAT = {"F32": np.float32, "F16": np.float16, "BF16": None}
LAYOUTS = {"Q4_1": IntLayout(4, 32, symmetric=False), "Q8_0": IntLayout(8, 32, symmetric=True)}
BLOCK = 32
NAMES = (  # GGUF tensor name -> Hugging Face's
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.attn_(q|k|v)\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
)


def choose(option: str, device: torch.device, tp_size: int) -> str:
    """``gguf_weights`` resolved: "auto" serves the file natively on one CPU process and
    converts it to fp32 elsewhere; "native" anywhere else is a ``ConfigError``."""
    if option not in GGUF_WEIGHTS:  # (EngineConfig checks it; this is for direct callers)
        raise ConfigError("model.gguf_weights", option, " or ".join(map(repr, GGUF_WEIGHTS)))
    fits = device.type == "cpu" and tp_size == 1
    if option == "native" and not fits:
        raise ConfigError("model.gguf_weights", option, '"fp32" or "auto" (native GGUF weights are served on the '
                          f"CPU by one process; this is {device.type} with tp_size {tp_size})")
    return "native" if option == "native" or (option == "auto" and fits) else "fp32"


def prepare(gguf: Path, target: Path) -> Path:
    """``target`` as a checkpoint directory whose weights are ``gguf``'s (module docstring)."""
    AutoConfig, AutoTokenizer = hf_names("AutoConfig", "AutoTokenizer")
    (causal_lm_names,) = hf_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", module="transformers.models.auto.modeling_auto")

    _reader(gguf)  # (refuses an architecture or a ggml type before anything is written)
    def build(staging: Path) -> None:
        staging.mkdir()
        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        cfg.architectures = [causal_lm_names[cfg.model_type]]
        cfg.save_pretrained(str(staging))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(staging))
        (staging / SOURCE).write_text(json.dumps({"file": str(gguf.resolve())}))

    return build_once(target, build, is_checkpoint)


def source(path: Path) -> Path | None:
    """The GGUF file whose weights the checkpoint directory ``path`` serves (None: its own)."""
    f = path / SOURCE
    return Path(json.loads(f.read_text())["file"]) if f.exists() else None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, ggml type name and bytes (a view of the mapped
    file: [rows, bytes per row] for a block type, [rows, columns] or [n] of floats)."""

    name: str
    kind: str
    data: np.ndarray


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read(gguf: Path) -> tuple[dict[str, object], list[GGUFTensor]]:
    """The file's scalar and string metadata and its tensors (the header only is parsed: the
    gguf package's reader would also decode every token of the vocabulary, seconds of a start).
    The layout is GGUF v2/v3's, ggml's type sizes the gguf package's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(gguf, mode="r")
    buf = memoryview(mm)
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != 0x46554747 or version < 2:
        raise QuantFormatError(f"{gguf.name}: not a GGUF v2/v3 file")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n:pos]).decode()

    def value(kind: int):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item == _STRING:
                for _ in range(count):
                    string()
            else:
                pos += count * struct.calcsize(_SCALARS[item])  # (arrays are skipped: the vocabulary)
            return None
        (v,) = struct.unpack_from(_SCALARS[kind], buf, pos)
        pos += struct.calcsize(_SCALARS[kind])
        return v

    meta = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(kind).name, offset))
    align = int(meta.get("general.alignment") or 32)
    start = -(-pos // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        rows = math.prod(dims[1:])
        row_bytes = dims[0] // block * size
        raw = mm[start + offset:start + offset + rows * row_bytes]
        if kind in FLOAT:
            data = raw.view(np.uint16 if kind == "BF16" else FLOAT[kind]).reshape(*reversed(dims))
        else:
            data = raw.reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, data))
    return meta, tensors


def _reader(gguf: Path) -> list[GGUFTensor]:
    """``read``'s tensors, the architecture and every ggml type checked."""
    meta, tensors = read(gguf)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise QuantFormatError(f"{gguf.name}: GGUF architecture {arch!r}; radixd serves {', '.join(ARCHITECTURES)} "
                               'GGUF files as shipped (gguf_weights = "fp32" converts others through transformers)')
    for t in tensors:
        if t.kind not in FLOAT and t.kind not in LAYOUTS:
            raise QuantFormatError(f"{gguf.name}: tensor {t.name!r} is ggml type {t.kind}; radixd serves "
                                   f"{', '.join([*FLOAT, *LAYOUTS])} as shipped (gguf_weights = \"fp32\" converts "
                                   "other types through transformers)")
    return tensors


def hf_name(name: str) -> str:
    for pattern, repl in NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise QuantFormatError(f"GGUF tensor {name!r} has no place in a llama model")


def _rows(name: str, cfg: ModelConfig) -> np.ndarray | None:
    """The row order that undoes llama.cpp's per-head q/k permutation (None: not q or k)."""
    heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads if ".attn_k." in name else None
    if heads is None:
        return None
    return np.arange(heads * cfg.head_dim).reshape(heads, cfg.head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


def _float(t: GGUFTensor) -> torch.Tensor:
    if t.kind == "BF16":
        return torch.from_numpy(t.data.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(t.data.astype(np.float32))


def canonical(t: GGUFTensor, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One Q4_1 / Q8_0 tensor in the ops' canonical layout (``weight``, ``weight_scale``,
    ``weight_zeros``), its rows in ``rows`` order."""
    kind = t.kind
    n = t.data.shape[0]
    blocks = torch.from_numpy(t.data.reshape(n, -1, 2 + (18 if kind == "Q4_1" else 32)).copy())
    if rows is not None:
        blocks = blocks[torch.from_numpy(rows)]
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128
        return {"weight": q.to(torch.uint8).view(n, -1), "weight_scale": d}
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = blocks[..., 4:]
    q = torch.cat((qs & 0xF, qs >> 4), -1)  # a block's low nibbles are its first 16 columns
    flat = d == 0  # every weight of the block is m
    q[flat] = 0
    s = torch.where(flat, m, d)
    z = torch.where(flat, torch.full_like(m, -1.0), -m / torch.where(flat, torch.ones_like(d), d))
    return {"weight": pack_int4(q.view(n, -1)), "weight_scale": s, "weight_zeros": z}


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """A tensor of any type read, as float32 (a Q4_1 embedding table; plain weights)."""
    if t.kind in FLOAT:
        return _float(t)
    c = canonical(t)
    lay = LAYOUTS[t.kind]
    return dequantize_int(c["weight"], c["weight_scale"], c.get("weight_zeros"), lay.bits, BLOCK)


def load(model: nn.Module, cfg: ModelConfig, gguf: Path, dtype: torch.dtype, device: torch.device,
         prefill_weights: str = "auto") -> nn.Module:
    """Fill ``model`` (built on "meta", already in ``dtype``) from ``gguf`` on the CPU ``device``;
    ``prefill_weights``: whether int4 weights keep bf16 copies for prefill (``[model]
    prefill_weights``, ``cpu_int.with_prefill_copies``)."""
    threads = torch.get_num_threads()
    # hundreds of small conversions: intra-op threads only add their hand-offs (several times
    # the work itself on a busy machine)
    torch.set_num_threads(1)
    try:
        return _load(model, cfg, gguf, dtype, device, prefill_weights)
    finally:
        torch.set_num_threads(threads)


def _load(model: nn.Module, cfg: ModelConfig, gguf: Path, dtype: torch.dtype, device: torch.device,
          prefill_weights: str) -> nn.Module:
    tensors = {t.name: t for t in _reader(gguf)}
    embed = tensors["token_embd.weight"]
    head = tensors.get("output.weight", embed)
    kinds: dict[str, set[str]] = {}
    for name, t in tensors.items():
        if name.startswith("blk.") and t.kind in LAYOUTS:
            kinds.setdefault(target_module(hf_name(name).removesuffix(".weight"), type(model).checkpoint_renames),
                             set()).add(t.kind)
    for module, types in kinds.items():
        if len(types) > 1:
            raise QuantFormatError(f"{gguf.name}: the tensors fused into {module} are of types {sorted(types)}; "
                                   'radixd fuses them only when of one type (gguf_weights = "fp32" converts them)')
    meta = torch.device("meta")
    for kind, layout in LAYOUTS.items():
        swap_projections(model, layout, {m: m for m, types in kinds.items() if types == {kind}}, torch.float32, meta)
    quant_head = head.kind in LAYOUTS
    quant_embed = embed.kind == "Q8_0"
    if quant_head:
        model.lm_head = nn.Module()  # (filled below, after the stream: it may share token_embd)
    if quant_embed:
        model.embed_tokens = QuantEmbedding(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings and not quant_head:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(_stream(tensors, cfg, skip={"output.weight", *(["token_embd.weight"] * quant_embed)}))
    if quant_head:
        model.lm_head = _quant_linear(head, cfg.hidden_size, cfg.vocab_size, device)
    pack_cpu_projections(model)
    copies = keep_cpu_prefill_copies(model, prefill_weights)
    if copies:
        log.info("int4 weights: bf16 copies for prefill, %.0f MB ([model] prefill_weights = %r)", copies / 1e6,
                 prefill_weights)
    if quant_embed:  # (int8 with whole groups: always packed)
        table = model.lm_head if head is embed else _quant_linear(embed, cfg.hidden_size, cfg.vocab_size, device)
        if table.cpu is None:
            table.pack_for_cpu()
        model.embed_tokens.table = table.cpu
    return model


def _stream(tensors: dict[str, GGUFTensor], cfg: ModelConfig, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors.items():
        if name in skip:
            continue
        hf = hf_name(name)
        rows = _rows(name, cfg)
        if t.kind in LAYOUTS and name.startswith("blk."):
            for suffix, tensor in canonical(t, rows).items():
                yield hf.removesuffix(".weight") + "." + suffix, tensor
        else:
            w = dequantize(t)
            yield hf, (w if rows is None else w[torch.from_numpy(rows)])


def _quant_linear(t: GGUFTensor, in_features: int, out_features: int, device: torch.device) -> QuantLinear:
    layer = QuantLinear(in_features, out_features, LAYOUTS[t.kind], bias=False, dtype=torch.float32,
                        device=device, name=repr(t.name))
    with torch.no_grad():
        for suffix, tensor in canonical(t).items():
            getattr(layer, suffix).copy_(tensor)
    return layer
