"""An EAGLE-3 draft head as SGLang loads it (``LlamaForCausalLMEagle3``): its checkpoint read
and checked against the target model, and its forward pass.

The checkpoint (a directory; every tensor name may also carry a ``model.`` prefix)::

    config.json   architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, hidden_size H
                  (target_hidden_size Ht: the target's, default H), num_attention_heads,
                  num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_*,
                  vocab_size (the target's), draft_vocab_size Vd, optionally
                  eagle_config.eagle_aux_hidden_state_layer_ids (the three target layers)
    fc.weight                                  [H, 3 Ht]   the three target streams fused
    midlayer.input_layernorm.weight            [H]         norms the token's embedding
    midlayer.hidden_norm.weight                [H]         norms the hidden state beside it
    midlayer.self_attn.{q,k,v}_proj.weight     [*, 2 H]    attention over [embedding ; hidden]
    midlayer.self_attn.o_proj.weight           [H, heads * head_dim]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.{gate,up}_proj.weight         [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                [H]
    lm_head.weight                             [Vd, H]  (none, and no draft_vocab_size: the target's)
    d2t                                        [Vd] int64: target id minus draft id
    t2d                                        [vocab] bool: the target ids the draft has
    embed_tokens.weight                        [vocab, H], optional: else the target's, shared

The target layers are those of ``eagle_aux_hidden_state_layer_ids``; without it SGLang's
default, the outputs of layers 1, L/2 - 1 and L - 4 of the target's L (SGLang captures the
stream entering layers 2, L/2, L - 3). What is read after a layer is the residual stream
there (the layer's output plus its residual input), before any norm.

The forward pass, one decoder layer per drafted position (``Eagle3Head.forward``)::

    g  = fc(target streams)  or  the head's own output stream one position back
    x  = [input_layernorm(embed(token)) ; hidden_norm(g)]
    s  = g + o_proj(attention(q, k, v of x))       (K/V of x stored in the head's KV region)
    s' = s + mlp(post_attention_layernorm(s))
    logits = lm_head(norm(s')) over the draft vocabulary;  s' is the next position's g

so position t of a sequence pairs token t + 1 with the target's stream at t (EAGLE's shift).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixd.core.attention import AttentionBackend
from radixd.core.errors import ConfigError
from radixd.core.model_loader import iter_safetensors
from radixd.core.models.config import ModelConfig
from radixd.core.models.layers import Attention, GatedMLP, RMSNorm, Rotary
from radixd.core.models.rope import rope_type
from radixd.core.triton_ops import linear

ARCHITECTURE = "LlamaForCausalLMEagle3"
KEY = "speculative_draft_model_path"


@dataclass(frozen=True)
class HeadSpec:
    """A head's checkpoint, read and checked against its target (``read_head``)."""

    path: Path
    cfg: ModelConfig               # the head's decoder layer (hidden_size H, heads, rope, ...)
    layers: tuple[int, ...]        # the target layers after which the streams are read, ascending
    draft_vocab: int               # Vd
    names: dict[str, str]          # canonical tensor name -> the checkpoint's
    own_embed: bool                # embed_tokens.weight in the checkpoint (else the target's)
    own_head: bool                 # lm_head.weight in the checkpoint (else the target's)
    fc_bias: bool


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default target layers for a target of ``num_layers``: their outputs' streams."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def _refuse(path: Path, what: str) -> ConfigError:
    return ConfigError(KEY, str(path), f"an EAGLE-3 head ({ARCHITECTURE}, SGLang's layout) for this model: {what}")


def read_head(path: str | Path, target: ModelConfig) -> HeadSpec:
    """Read the head at ``path`` (config.json and the safetensors headers, no tensor data) and
    check it against ``target``: a ``ConfigError`` naming the file or tensor and what was
    expected where it does not fit."""
    path = Path(path).expanduser()
    conf = path / "config.json"
    if not conf.is_file():
        raise _refuse(path, "a directory with config.json and safetensors files")
    with open(conf) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise _refuse(path, f"config.json architectures {archs!r}: expected [{ARCHITECTURE!r}]")
    if hf.get("num_hidden_layers", 1) != 1:
        raise _refuse(path, f"config.json num_hidden_layers {hf.get('num_hidden_layers')!r}: expected 1")
    try:
        cfg = ModelConfig.from_hf({**hf, "num_hidden_layers": 1})
    except (KeyError, ValueError) as exc:
        raise _refuse(path, f"config.json: {exc}") from exc
    h, ht = cfg.hidden_size, hf.get("target_hidden_size") or cfg.hidden_size
    if ht != target.hidden_size:
        raise _refuse(path, f"config.json target hidden size {ht}: expected the model's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise _refuse(path, f"config.json vocab_size {cfg.vocab_size}: expected the model's {target.vocab_size}")
    layers = _layers(path, hf, target.num_layers)

    shapes = _shapes(path)
    names = {k.removeprefix("model."): k for k in shapes}
    own_head = "lm_head.weight" in names
    vd = hf.get("draft_vocab_size")
    if vd is None:
        vd = shapes[names["lm_head.weight"]][0] if own_head else target.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    want = {
        "fc.weight": (h, 3 * ht),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,),
    }
    optional = {"fc.bias": (h,), "embed_tokens.weight": (target.vocab_size, h), "lm_head.weight": (vd, h),
                "d2t": (vd,), "t2d": (target.vocab_size,)}
    for name, shape in want.items():
        if name not in names:
            raise _refuse(path, f"tensor {name!r} is missing (expected shape {list(shape)})")
    for name, shape in {**want, **optional}.items():
        if name in names and tuple(shapes[names[name]]) != shape:
            raise _refuse(path, f"tensor {name!r} has shape {list(shapes[names[name]])}: expected {list(shape)}")
    if not own_head and vd != target.vocab_size:
        raise _refuse(path, f"tensor 'lm_head.weight' is missing (expected shape {[vd, h]} for draft_vocab_size {vd})")
    if vd < target.vocab_size and "d2t" not in names:
        raise _refuse(path, f"tensor 'd2t' is missing (expected shape {[vd]}: a draft vocabulary of {vd} ids "
                      f"of the model's {target.vocab_size})")
    if h != target.hidden_size and "embed_tokens.weight" not in names:
        raise _refuse(path, f"tensor 'embed_tokens.weight' is missing (expected shape {[target.vocab_size, h]}: "
                      f"the head's hidden size {h} is not the model's {target.hidden_size})")
    return HeadSpec(path=path, cfg=cfg, layers=layers, draft_vocab=vd, names=names,
                    own_embed="embed_tokens.weight" in names, own_head=own_head, fc_bias="fc.bias" in names)


def _layers(path: Path, hf: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers the head reads (ascending), from its config or SGLang's default."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if ids is None:
        ids, field = default_layers(num_layers), f"the default layers (1, L/2 - 1, L - 4 of L = {num_layers})"
    ok = (isinstance(ids, list | tuple) and len(ids) == 3 and all(isinstance(i, int) for i in ids)
          and len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids))
    if not ok:
        raise _refuse(path, f"config.json {field} = {list(ids)}: expected three distinct layers of the model's "
                      f"0..{num_layers - 1}")
    return tuple(sorted(ids))


def _shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the safetensors headers."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _refuse(path, "safetensors files beside config.json (none found)")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                out[key] = list(f.get_slice(key).get_shape())
    return out


class Eagle3Head(nn.Module):
    """The head's layer, norms and LM head (see the module docstring); ``embed_tokens`` and,
    without its own, ``lm_head`` are the target's modules (shared, not copied)."""

    def __init__(self, spec: HeadSpec, target: nn.Module):
        super().__init__()
        cfg = spec.cfg
        h, ht = cfg.hidden_size, target.cfg.hidden_size
        self.fc = nn.Linear(3 * ht, h, bias=spec.fc_bias)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, qkv_bias=False, qk_norm=False)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.self_attn.qkv_proj = nn.Linear(2 * h, q + 2 * kv, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if spec.own_embed else None
        self.lm_head = nn.Linear(h, spec.draft_vocab, bias=False) if spec.own_head else None
        self.d2t: torch.Tensor | None = None  # [Vd] target id - draft id (None: the same ids)
        self.rotary: Rotary | None = None  # (made on the device by ``load_head``)
        self._target = (target,)  # (not a submodule: the target's weights are not the head's)

    @property
    def positions(self) -> int:
        """Positions the rotary table covers."""
        return self.rotary.cos.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self._target[0].embed_tokens if self.embed_tokens is None else self.embed_tokens
        return embed(ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary."""
        return linear(x, self._target[0].lm_head if self.lm_head is None else self.lm_head).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids as the target's."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def forward(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` (target ids) with their hidden states ``g`` [T, H] at ``positions``
        (their K/V stored through ``attn``, whose batch it is); at the rows ``last`` (None:
        all) the output stream s' and its normed value, whose logits are ``logits``."""
        x = torch.cat((self.input_layernorm(self.embed(ids)), self.hidden_norm(g)), dim=-1)
        a = self.self_attn(x, positions, self.rotary, attn)
        if last is not None:  # (only the K/V of the other rows are wanted)
            a, g = a[last], g[last]
        s = g + a
        s = s + self.mlp(self.post_attention_layernorm(s))
        return s, self.norm(s)


def load_head(spec: HeadSpec, target: nn.Module, dtype: torch.dtype, device: torch.device,
              context_len: int) -> Eagle3Head:
    """The head of ``spec`` on ``device`` in ``dtype``, sharing ``target``'s embedding (and LM
    head, where it has none of its own)."""
    with torch.device("meta"):
        head = Eagle3Head(spec, target)
    head = head.to(dtype=dtype).to_empty(device=device)
    params = dict(head.named_parameters())
    fused = {"midlayer.self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
             "midlayer.self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
             "midlayer.self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
             "midlayer.mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
             "midlayer.mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1)}
    parts: dict[str, list] = {"self_attn.qkv_proj.weight": [None] * 3, "mlp.gate_up_proj.weight": [None] * 2}
    known = {*fused, "fc.weight", "fc.bias", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
             "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"}
    wanted = {v: k for k, v in spec.names.items() if k in known}  # checkpoint name -> canonical
    d2t = t2d = None
    with torch.no_grad():
        for key, tensor in iter_safetensors(spec.path, only=wanted.__contains__):
            name = wanted[key]
            if name in fused:
                dest, i = fused[name]
                parts[dest][i] = tensor
            elif name == "d2t":
                d2t = tensor.to(torch.int64)
            elif name == "t2d":
                t2d = tensor.to(torch.bool)  # (only checked: d2t says where each draft id goes)
            else:
                dest = name.removeprefix("midlayer.")
                params[dest].copy_(tensor)
        for dest, ts in parts.items():
            params[dest].copy_(torch.cat(ts, dim=0))
    if d2t is not None:
        ids = d2t + torch.arange(d2t.numel())
        if ids.min() < 0 or ids.max() >= spec.cfg.vocab_size:
            raise _refuse(spec.path, f"tensor 'd2t' maps draft ids outside the model's vocabulary "
                          f"0..{spec.cfg.vocab_size - 1}")
        if t2d is not None and (int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all())):
            raise _refuse(spec.path, "tensor 't2d' marks other target ids than 'd2t' maps the draft ids to")
        head.d2t = d2t.to(device)
    # (a table as long as the target's context where the positions only set its length)
    longest = max(spec.cfg.max_position_embeddings, context_len)
    if rope_type(spec.cfg.rope_scaling) not in ("default", "linear", "llama3"):
        longest = spec.cfg.max_position_embeddings
    head.rotary = Rotary(spec.cfg.head_dim, longest, spec.cfg.rope_theta, spec.cfg.rope_scaling).to(device)
    return head.eval()
