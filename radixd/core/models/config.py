"""The model shape radixd needs, read from a Hugging Face ``config.json``; a field asking
for something radixd does not implement is refused here, naming the field and its value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixd.core.models.rope import ROPE_TYPES, rope_type, served_positions


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP's shape and routing."""

    num_experts: int
    top_k: int                     # experts per token
    intermediate_size: int         # each expert's MLP width
    renormalize: bool              # top-k weights rescaled to sum to 1 (Qwen's ``norm_topk_prob``)
    shared_intermediate_size: int  # Qwen2-MoE's shared expert's width (0: none)
    dense_layers: tuple[int, ...]  # layers whose MLP is dense (``intermediate_size`` wide)

    @classmethod
    def from_hf(cls, arch: str, hf: dict[str, Any]) -> MoEConfig | None:
        """Mixtral: softmax over the top-k logits (the same as softmax, top-k, renormalise);
        Qwen2-MoE / Qwen3-MoE: softmax, top-k, renormalised if ``norm_topk_prob``; their
        ``mlp_only_layers`` and the layers off ``decoder_sparse_step`` are dense."""
        if arch == "MixtralForCausalLM":
            return cls(num_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 2),
                       intermediate_size=hf["intermediate_size"], renormalize=True,
                       shared_intermediate_size=0, dense_layers=()).checked()
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return None
        experts = hf.get("num_experts", hf.get("num_local_experts"))  # (transformers 5 writes the latter)
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise unsupported("decoder_sparse_step", step, "an integer >= 1")
        only = set(hf.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(hf["num_hidden_layers"])
                      if i in only or not experts or (i + 1) % step)
        shared = (hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        return cls(num_experts=experts or 0, top_k=hf.get("num_experts_per_tok", 1),
                   intermediate_size=hf["moe_intermediate_size"], renormalize=bool(hf.get("norm_topk_prob", False)),
                   shared_intermediate_size=shared, dense_layers=dense).checked()

    def checked(self) -> MoEConfig:
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise unsupported("num_experts_per_tok", self.top_k, f"1..{self.num_experts} (the experts)")
        return self


def unsupported(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"model config field {field!r} = {value!r} is not supported; radixd implements {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    # Granite's scalings: q.k times ``attention_multiplier`` (None: head_dim ** -0.5), the
    # embeddings times ``embedding_multiplier``, each block's output times
    # ``residual_multiplier`` before it joins the stream, the logits over ``logits_scaling``.
    attention_multiplier: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: global; (): no windows)
    # Gemma 2 / 3: the MLP's activation, tanh soft-capping of attention scores and of the
    # final logits (0: none), the sliding layers' own rope base (None: the model's).
    hidden_act: str = "silu"
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    local_rope_theta: float | None = None
    # A quantized checkpoint's format and layout (``radixd.core.quant.formats.Scheme``; set by
    # ``model_loader.read_config``); None: plain weights.
    quant: Any = None

    @property
    def attention_scale(self) -> float:
        """The attention backend's q.k scale."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def context_len(self) -> int:
        """Longest sequence the model serves (``dynamic`` rope scaling stretches it by its
        factor; sliding windows do not shorten it)."""
        return served_positions(self.max_position_embeddings, self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        gemma = arch in GEMMA
        act = hf.get("hidden_act", "silu")
        if gemma:
            act = hf.get("hidden_activation") or act
            if act != "gelu_pytorch_tanh":
                raise unsupported("hidden_activation", act, "'gelu_pytorch_tanh' (GeGLU) for Gemma")
        elif act != "silu":
            raise unsupported("hidden_act", act, "'silu' (SwiGLU MLPs)")
        if hf.get("mlp_bias"):
            raise unsupported("mlp_bias", hf["mlp_bias"], "MLPs without bias (false)")
        if hf.get("attention_bias") and arch not in QKV_BIAS:  # (transformers then biases o_proj too)
            raise unsupported("attention_bias", hf["attention_bias"], "attention without bias (false)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            window = None
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 keeps both here
        extra = gemma_fields(arch, hf) if gemma else {}
        extra["layer_windows"] = layer_windows(arch, hf) if window else ()
        if gemma and rope_params and "full_attention" in rope_params:  # per layer type (transformers >= 5)
            rope_params = rope_params["full_attention"]
        if rope_params:
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        rope_scaling = checked_rope(rope_scaling, hf)
        return cls(
            architecture=arch,
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),  # (Gemma's default: tied)
            attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch in QKV_BIAS))),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf(arch, hf),
            **(granite_scalings(hf) if arch == "GraniteForCausalLM" else {}),
            **extra,
        )


def checked_rope(scaling: dict | None, hf: dict[str, Any]) -> dict | None:
    """The rope scaling with Phi-3's top-level ``original_max_position_embeddings`` in it;
    a type or a partial rotary radixd lacks refused."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise unsupported("rope_scaling.rope_type", kind, ", ".join(ROPE_TYPES))
    for params in (hf, scaling or {}):
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported("partial_rotary_factor", params["partial_rotary_factor"], "1.0 (rotary on every dimension)")
    if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in scaling:
        if "original_max_position_embeddings" not in hf:
            raise unsupported("rope_scaling.original_max_position_embeddings", None, f"it set for {kind!r}")
        scaling = {**scaling, "original_max_position_embeddings": hf["original_max_position_embeddings"]}
    return scaling


def layer_windows(arch: str, hf: dict[str, Any]) -> tuple[int, ...]:
    """``sliding_window`` on the ``layer_types`` that slide; without the list, transformers'
    default: Gemma 2 every other layer from the first, Gemma 3 five of every six (its
    ``sliding_window_pattern``), Qwen those from ``max_window_layers`` on, others all."""
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}.get(arch, 0))
    first = hf.get("max_window_layers", 28) if arch.startswith("Qwen") else 0
    types = hf.get("layer_types") or [
        "full_attention" if (pattern and not (i + 1) % pattern) or i < first else "sliding_attention"
        for i in range(layers)]
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise unsupported("layer_types", t, "'sliding_attention', 'full_attention'")
    window = hf["sliding_window"]
    if window >= hf.get("max_position_embeddings", 4096):
        window = 0  # (as wide as the context: no window at all, and the kernels' unwindowed paths)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def gemma_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's scalings, soft-caps and local rope base."""
    if not hf.get("sliding_window"):
        raise unsupported("sliding_window", hf.get("sliding_window"), "a window for Gemma's sliding layers")
    if hf.get("use_bidirectional_attention"):
        raise unsupported("use_bidirectional_attention", True, "causal attention (false)")
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        params = hf.get("rope_parameters") or {}
        local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        if rope_type(local) != "default":
            raise unsupported("rope_parameters.sliding_attention.rope_type", rope_type(local), "'default'")
        local_theta = float(local["rope_theta"])
    return dict(hidden_act="gelu_pytorch_tanh",
                attention_multiplier=hf["query_pre_attn_scalar"] ** -0.5,
                embedding_multiplier=hf["hidden_size"] ** 0.5,
                attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                local_rope_theta=local_theta)


def granite_scalings(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(attention_multiplier=hf.get("attention_multiplier"),
                embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                logits_scaling=float(hf.get("logits_scaling", 1.0)))


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # bias on q/k/v unless the config says otherwise
