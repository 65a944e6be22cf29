"""Hugging Face checkpoint tensors -> a radixd model's parameters.

Checkpoints keep q/k/v, gate/up and every expert's projections as tensors of their own; radixd's
models fuse them (``qkv_proj``, ``gate_up_proj``) and stack the experts of a layer
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]). Each checkpoint tensor
fills one *part* of one parameter: ``()`` all of it, ``(s,)`` shard s of a fused projection,
``(e, s)`` / ``(e,)`` expert e's gate or up rows / its down projection (a checkpoint that
already stacks them, as transformers 5 holds them in memory, fills ``()``). Every part of
every parameter must be filled: a missing tensor is an error, not random weights. A quantized
projection (``radixd.core.quant``) has its canonical tensors filled the same way (``q_proj.weight_scale``
fills part 0 of ``qkv_proj.weight_scale``; block scales' rows in proportion to the parts' rows); fp8
or integer data never lands in a float parameter, nor the reverse.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from radixd.core.kv_quant import is_scale_name

# checkpoint suffix -> (fused parameter suffix, shard index)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale)?$")
STACKED_GATE_UP = (".experts.gate_up_proj", ".experts.gate_up_proj_scale")
STACKED_DOWN = (".experts.down_proj", ".experts.down_proj_scale")
Part = tuple[int, ...]


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, qkv_sizes: list[int],
                    renames: tuple[tuple[str, str], ...] = (), head: bool = True) -> None:
    """Copy Hugging Face-named ``weights`` into ``model``'s parameters. ``qkv_sizes``: the
    rows of q, k and v in ``qkv_proj``; ``renames``: (regex, replacement) pairs applied to
    each checkpoint name first (a family's names onto radixd's); ``head`` False: an untied
    LM head may be missing (zeros then: an embedding engine never reads it)."""
    tied = model.cfg.tie_word_embeddings
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Part]] = set()
    for name, tensor in weights:
        if is_scale_name(name.removeprefix("model.")):
            continue  # a KV cache scale (read by core.kv_quant for an fp8 pool), not a weight
        name = model_name(name, renames)
        if "rotary_emb" in name or (name == "lm_head.weight" and tied):
            continue
        target, part = _place(name)
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if target.endswith(".weight_perm") and any(t == target for t, _ in loaded) and not torch.equal(param, tensor.to(param.device)):
            raise ValueError(f"tensor {name!r}: its act-order permutation differs from the other projections "
                             f"fused into {target.removesuffix('.weight_perm')!r} (they share one input)")
        with torch.no_grad():
            _copy(_view(target, param, part, qkv_sizes), tensor, name)
        loaded.add((target, part))
    missing = [f"{p}{'#' + ','.join(map(str, part)) if part else ''}"
               for p, param in params.items() if not (p == "lm_head.weight" and tied) and (p, ()) not in loaded
               for part in _parts(p, param) if (p, part) not in loaded]
    if not head and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
        with torch.no_grad():
            params["lm_head.weight"].zero_()
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def model_name(name: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    """A checkpoint tensor's name in radixd's terms (before fusing): ``model.`` dropped and
    the family's ``renames`` applied."""
    name = name.removeprefix("model.")
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def target_module(name: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    """The radixd module a checkpoint projection (``model.layers.0.self_attn.q_proj``) goes to."""
    return _place(model_name(name, renames) + ".weight")[0].removesuffix(".weight")


def _place(name: str) -> tuple[str, Part]:
    """The parameter a checkpoint tensor goes to, and which part of it."""
    m = EXPERT.match(name)
    if m:  # (an fp8 expert's scale goes to the stacked scales, ``moe.Experts``)
        base, e, proj, scale = m.groups()
        if proj == "down_proj":
            return f"{base}.down_proj{scale or ''}", (int(e),)
        return f"{base}.gate_up_proj{scale or ''}", (int(e), 0 if proj == "gate_proj" else 1)
    for ckpt, (fused, idx) in FUSED.items():
        if f".{ckpt}." in name:
            return name.replace(ckpt, fused), (idx,)
    return name, ()


def _parts(pname: str, param: torch.Tensor) -> list[Part]:
    """Every part of a parameter the checkpoint must fill."""
    if pname.endswith(STACKED_GATE_UP):
        return [(e, s) for e in range(param.shape[0]) for s in (0, 1)]
    if pname.endswith(STACKED_DOWN):
        return [(e,) for e in range(param.shape[0])]
    kind = pname.rsplit(".", 2)[-2] if "." in pname else ""
    return {"qkv_proj": [(0,), (1,), (2,)], "gate_up_proj": [(0,), (1,)]}.get(kind, [()])


def _view(pname: str, param: torch.Tensor, part: Part, qkv_sizes: list[int]) -> torch.Tensor:
    """The slice of ``param`` that ``part`` names."""
    if not part:
        return param
    if pname.endswith(STACKED_GATE_UP):  # (block scales: half the blocks of rows each)
        e, s = part
        half = param.shape[1] // 2
        return param[e].narrow(0, s * half, half)
    if pname.endswith(STACKED_DOWN):
        return param[part[0]]
    if pname.endswith(".weight_perm"):
        return param  # a quantized projection's input order: the same for each part (one input)
    rows = param.shape[0]
    sizes = qkv_sizes if pname.rsplit(".", 2)[-2] == "qkv_proj" else [rows // 2] * 2
    # Rows in proportion: a quantized projection's block scales have one row per block of rows.
    total = sum(sizes)
    if any(rows * s % total for s in sizes):
        raise ValueError(f"parameter {pname!r}: {rows} rows do not split as the fused parts {sizes} "
                         "(fp8 blocks that straddle two of them)")
    return param.narrow(0, rows * sum(sizes[: part[0]]) // total, rows * sizes[part[0]] // total)


PLAIN = (torch.float32, torch.bfloat16, torch.float16)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    if src.dtype != dst.dtype and not (src.dtype in PLAIN and dst.dtype in PLAIN):
        # fp8 or integer tensors are quantized data: never cast into a float parameter (nor back)
        raise ValueError(f"tensor {name!r}: {src.dtype} in the checkpoint, the model expects {dst.dtype} "
                         "(a quantized projection without its scales, or a plain one in a quantized layer)")
    dst.copy_(src)
