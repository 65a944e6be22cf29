"""The engine's configuration schema: every option declared once, checked by one function.

Each ``EngineConfig`` field is an ``option``: its default, its bounds (``min``/``max``), its
``choices``, whether SIGHUP may change it (``live``) and, for options the daemon's file
offers, its ``radixd.toml`` key (``key="scheduler.overlap"``). ``check`` reads that metadata;
it validates a field when an ``EngineConfig`` is built (error key: the field's name) and a
value read from the file (error key: ``section.key``), so each option has one set of bounds
and one message. ``radixd.settings`` builds the file's engine sections from these keys (it
adds the daemon's own); ``HostTierOptions``/``DiskTierOptions`` declare the built-in tiers'
tables (``[cache.host]``, ``[cache.disk]``) the same way.

The file has no null: an ``X | None`` option is spelled there by X's empty value (``0``,
``""``, ``[]``), which ``from_file`` reads back as None. Adding an engine option is one
``option(...)`` line here; with a ``key`` it also needs its entry in radixd.toml and
man/radixd.toml.5 (tests/test_docs.py checks they agree).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from radixd.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
WRITE_POLICIES = ("write_back", "write_through", "write_through_hits")
ROUTING_POLICIES = ("cache_aware", "round_robin")
TASKS = ("auto", "generate", "embed")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")  # see core.kv_quant
GGUF_WEIGHTS = ("auto", "native", "fp32")  # (core.gguf serves "native")
PREFILL_WEIGHTS = ("auto", "bf16", "dequantize")  # (quant.cpu_int.with_prefill_copies)
QUANTIZATION = ("auto", "none", "compressed-tensors", "fp8", "gptq", "awq")  # (core.quant.formats reads them)


def option(default: Any, *, key: str | None = None, min: float | None = None, max: float | None = None,
           choices: tuple | None = None, live: bool = False, nonempty: bool = False,
           required: bool = False, allowed: str | None = None) -> Any:
    """A dataclass field with its checking metadata. ``key``: its ``section.key`` in the
    daemon's file (None: an engine-only option); ``live``: re-read on SIGHUP; ``nonempty``: a
    string that must not be empty; ``required``: a tier option that must be given (not empty)
    when the tier is in use; ``allowed``: the wording of what is allowed, where the generic
    one ("a string") would say too little."""
    meta = {"key": key, "min": min, "max": max, "choices": choices, "live": live, "nonempty": nonempty,
            "required": required, "allowed": allowed}
    if isinstance(default, list | tuple | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def check(key: str, value: Any, hint: Any, meta: typing.Mapping[str, Any], *, unset: Any = MISSING) -> None:
    """Refuse ``value`` unless it has the type ``hint`` and the metadata's bounds and choices,
    with a ``ConfigError`` naming ``key``, the value and what is allowed. ``unset``: the
    spelling of None in a file (accepted and named in the message)."""
    if value is None and type(None) in typing.get_args(hint):
        return
    hint = _not_none(hint)
    if unset is not MISSING and value == unset and type(value) is type(unset):
        return
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, value, meta.get("allowed") or "a list of strings")
        return
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, meta.get("allowed") or "a table")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
        return
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    elif hint is str:
        ok = isinstance(value, str) and not (meta.get("nonempty") and not value)
    else:  # pragma: no cover - a new option type needs a branch here
        raise TypeError(f"config: no check for {hint!r}")
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if (not ok or (choices is not None and value not in choices)
            or (lo is not None and value < lo) or (hi is not None and value > hi)):
        raise ConfigError(key, value, meta.get("allowed") or allowed(hint, lo, hi, choices, unset))


def allowed(hint: type, lo: float | None, hi: float | None, choices: tuple | None, unset: Any = MISSING) -> str:
    """What ``check`` says is allowed, e.g. "an integer >= 1", "one of 'a', 'b'"."""
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    kind = {int: "an integer", float: "a number", str: "a string"}[hint]
    if lo is not None and hi is not None:
        text = f"{kind} in [{lo}, {hi}]"
    elif lo is not None:
        text = f"{kind} >= {lo}"
    else:
        return kind
    return text if unset is MISSING else f"{unset!r} or {text}"


def check_fields(obj: Any) -> None:
    """``check`` every field of the dataclass ``obj`` (error keys: the field names)."""
    hints = _hints(type(obj))
    for f in fields(obj):
        check(f.name, getattr(obj, f.name), hints[f.name], f.metadata)


def _not_none(hint: Any) -> Any:
    """``X`` of ``X | None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass (annotations are strings here), computed once."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def file_type(hint: Any) -> Any:
    """How an option's type is written in the file: ``X | None`` as X, tuples as lists."""
    hint = _not_none(hint)
    if typing.get_origin(hint) is tuple:
        return list[str]
    return hint


def file_unset(hint: Any) -> Any:
    """The file's spelling of None for an ``X | None`` option (MISSING for the others)."""
    if type(None) not in typing.get_args(hint):
        return MISSING
    return {int: 0, float: 0.0, str: "", list[str]: []}[file_type(hint)]


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to serve one model; checked on construction (``ConfigError``).

    ``model`` is a Hugging Face checkpoint directory (config.json + safetensors), a ``.gguf``
    file, or ``"default"`` for the bundled SmolLM2-135M-Instruct (converted once into
    ``cache_dir``).
    """

    model: str = option("default", key="model.path", nonempty=True,
                        allowed="a checkpoint directory, a .gguf file or 'default'")
    tokenizer: str | None = option(None, key="model.tokenizer")  # a directory; "none": token ids only
    dtype: str = option("auto", key="model.dtype", choices=DTYPES)
    device: str = option("auto", key="model.device", choices=DEVICES)
    attention_backend: str = option("auto", key="model.attention_backend", choices=ATTENTION_BACKENDS)
    # "embed": an embedding model (/v1/embeddings only); "generate": text only; "auto": embed
    # when the checkpoint has sentence-transformers files (modules.json), see core.pooling.
    task: str = option("auto", key="model.task", choices=TASKS)
    # Capture decode steps as CUDA graphs (batch-size buckets up to max_running_requests).
    cuda_graphs: bool = option(True, key="model.cuda_graphs")
    # Also steps that decode and prefill together (cuda_graph.MixedGraphs), where decode steps
    # are captured, on one device, without an EAGLE-3 drafter; false: they run eagerly.
    mixed_cuda_graphs: bool = option(True, key="model.mixed_cuda_graphs")
    # Those graphs' token buckets reach max_running_requests + this; 0: the step's prompt
    # budget (mixed_prefill_tokens), at most assembly.MIXED_GRAPH_TOKENS_MAX.
    mixed_graph_tokens: int = option(0, key="model.mixed_graph_tokens", min=0)
    # Decode requests that share a cached prefix read its KV once for all of them (two-level
    # "cascade" attention; the triton backend).
    cascade_attention: bool = option(True, key="model.cascade_attention")
    # Optional kernels (triton_ops.KernelChoice; benchmarks compare both ways): one-row
    # projections with the next element-wise step in the GEMV's epilogue, and the few-row
    # projection kernel where it was measured faster than cuBLAS. Engine options only.
    fuse_one_row: bool = option(True)
    rows_kernel: bool = option(True)
    # The decode path's Triton kernels (norms, GEMVs, few-row GEMMs, rotary and store, decode
    # attention) launched with programmatic dependent launch: each starts while the one
    # before drains and waits on the device (CUDA, compute capability 9.0+). Engine option.
    pdl: bool = option(False)
    # Decode attention's split partials merged by the last of each request's split programs
    # (an atomic count) instead of a second kernel: one launch a layer fewer (triton backend;
    # triton_kernels.decode_attention's merge_in_kernel). Engine option.
    decode_merge_in_kernel: bool = option(False)
    # Prompt chunks of 256+ tokens attend in cuDNN's fused kernels (triton backend, 16-bit KV)
    # over a fixed set of plans built at start (2.4 s on an H200 at the default limits;
    # attention.dense_prefill), in steps with enough device work to hide their host time: on an
    # H200 1.6x the extend kernel's speed on 8 x 2048 fresh prompts, 1.4x on a 32k prompt's
    # last chunk, and no plan built while serving.
    dense_prefill: bool = option(True, key="model.dense_prefill")
    cache_dir: str | None = option(None, key="model.cache_dir")
    max_context_len: int | None = option(None, key="model.max_context_len", min=2)
    # "dummy": random weights of the checkpoint's shape, no weight files (benchmarks).
    load_format: str = option("auto", choices=LOAD_FORMATS)
    # Quantized weights: "auto" (as the checkpoint's quantization_config declares), "none" (a
    # plain checkpoint only) or a format that the checkpoint must have (core.quant.formats).
    quantization: str = option("auto", key="model.quantization", choices=QUANTIZATION)
    # A GGUF model's weights: "native" (its Q4_1 / Q8_0 tensors served as shipped, CPU kernels;
    # core.gguf), "fp32" (converted once through transformers) or "auto", the default (native
    # on the CPU with tp_size 1, fp32 elsewhere).
    gguf_weights: str = option("auto", key="model.gguf_weights", choices=GGUF_WEIGHTS)
    # CPU int4 weights (a native GGUF's Q4_1): "bf16" keeps a bf16 copy that prefill's GEMMs
    # read (2 bytes a weight more memory; decode steps still read int4), "dequantize" makes it
    # anew each prefill step, "auto" keeps copies of at most 1 GiB and an eighth of the memory.
    prefill_weights: str = option("auto", key="model.prefill_weights", choices=PREFILL_WEIGHTS)

    # KV memory. ``kv_cache_bytes`` wins over ``kv_cache_tokens`` when both are set.
    kv_cache_bytes: int | None = option(None, key="memory.kv_cache_bytes", min=1)
    kv_cache_tokens: int | None = option(None, key="memory.kv_cache_tokens", min=2)
    # On CUDA without an explicit size: share of the free memory after the weights.
    mem_fraction: float = option(0.85, key="memory.mem_fraction", min=0.05, max=0.98)
    # What the pool stores K and V in: "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2"
    # (half the bytes of bf16 per token; per-layer scales from the checkpoint, else 1.0), or
    # "bfloat16" / "float16": the model's dtype, or on the CPU a float32 model's K/V in half
    # its bytes (read in float32 by the decode kernels).
    kv_cache_dtype: str = option("auto", key="memory.kv_cache_dtype", choices=KV_CACHE_DTYPES)
    # Models with sliding-window layers: their KV in a region of its own, this many window
    # tokens per pool slot (at least a prefill chunk and a window), freed behind the windows
    # (swa_pool); 0: kept whole like the global layers' KV (so too with cache_tiers, which
    # store every layer's KV by slot).
    swa_full_tokens_ratio: float = option(0.8, min=0.0, max=1.0)

    # Radix cache.
    radix_cache: bool = option(True, key="cache.radix")
    # Lower cache tiers, fastest first (names from the radixd_cache_tiers hook: "host",
    # "disk", plugins' tiers); empty: the pool only.
    cache_tiers: tuple[str, ...] = option((), key="cache.tiers",
                                          allowed="a list of tier names, e.g. ['host', 'disk']")
    # Tokens per page stored in the tiers (only whole pages are stored).
    cache_page_tokens: int = option(16, key="cache.page_tokens", min=1)
    # When pages go down: "write_back" (on eviction from the pool), "write_through" (when a
    # request leaves), "write_through_hits" (when it leaves, for prefixes hit cache_write_hits times).
    cache_write_policy: str = option("write_back", key="cache.write_policy", choices=WRITE_POLICIES)
    cache_write_hits: int = option(2, key="cache.write_hits", min=1)
    # Prefetch pages of arriving requests from slow tiers into the first (memory) tier.
    cache_prefetch: bool = option(True, key="cache.prefetch")
    # Each tier's options, by tier name (the [cache.NAME] tables of radixd.toml).
    cache_tier_options: dict = option({}, allowed="a table of tables, one per tier name")

    # Scheduler.
    policy: str = option("lpm", key="scheduler.policy", nonempty=True,
                         allowed="the name of a loaded scheduling policy")
    max_running_requests: int = option(64, key="scheduler.max_running_requests", min=1)
    max_prefill_tokens: int = option(4096, key="scheduler.max_prefill_tokens", min=1)
    chunked_prefill_size: int = option(2048, key="scheduler.chunked_prefill_size", min=1)
    # Prompt tokens of a step that also decodes (0: assembly.MIXED_PREFILL_CAPTURED where such
    # steps replay CUDA graphs, else max_prefill_tokens): a smaller budget keeps the decoding
    # requests' inter-token latency flat while prompts arrive.
    mixed_prefill_tokens: int = option(0, key="scheduler.mixed_prefill_tokens", min=0)
    # Fraction of each running request's remaining max_new_tokens kept free when admitting.
    schedule_conservativeness: float = option(0.3, key="scheduler.schedule_conservativeness", min=0.0, max=1.0)
    # Launch step N+1 before reading step N's picks (the device never waits for the host).
    overlap_schedule: bool = option(True, key="scheduler.overlap")
    # tokens per streamed update of a request (1: every token)
    stream_interval: int = option(1, key="scheduler.stream_interval", min=1)
    seed: int = option(0, key="scheduler.seed", min=0)
    # While running: start-up objects frozen out of the garbage collector's walks, and its
    # youngest generation's threshold raised to at least this (0: Python's); see gc_control.
    gc_freeze: bool = option(True, key="scheduler.gc_freeze")
    gc_threshold: int = option(10000, key="scheduler.gc_threshold", min=0)
    lpm_dedup_min_tokens: int = option(32, min=1)

    # Several devices: ``dp_size`` replicas (each a model copy, KV pool, radix tree and
    # scheduler), each split over ``tp_size`` devices (heads and MLP columns per device).
    dp_size: int = option(1, key="parallel.dp_size", min=1)
    tp_size: int = option(1, key="parallel.tp_size", min=1)
    # tp on CUDA: sum small partials (decode steps) with radixd's one-shot kernel over peer-to-
    # peer memory where the GPUs can address each other; NCCL for the rest (and when off).
    peer_all_reduce: bool = option(True, key="parallel.peer_all_reduce")
    # Which replica serves a request: "cache_aware" (the longest cached prefix unless that
    # replica has more than ``routing_balance_threshold`` requests over the least-loaded one
    # and more than ``routing_balance_ratio`` times its load; see router.py) or "round_robin".
    routing: str = option("cache_aware", key="parallel.routing", choices=ROUTING_POLICIES)
    routing_balance_threshold: int = option(16, key="parallel.routing_balance_threshold", min=0)
    routing_balance_ratio: float = option(1.25, key="parallel.routing_balance_ratio", min=1.0)

    # Structured generation (radixd.grammars).
    # a backend from the radixd_grammar_backends hook
    grammar_backend: str = option("radixd", key="grammar.backend", nonempty=True,
                                  allowed="the name of a loaded grammar backend")
    # seconds; a slower compile fails its request (400)
    grammar_compile_timeout: float = option(10.0, key="grammar.compile_timeout", min=0.001)
    # threads compiling grammars off the event loop
    grammar_compile_workers: int = option(2, key="grammar.compile_workers", min=1)
    # a new grammar first compiles in a worker process under this memory limit (and the
    # time limit), killed if it explodes; 0: no such trial (threads only)
    grammar_compile_memory_mb: int = option(1024, key="grammar.compile_memory_mb", min=0)
    # compiled grammars kept (LRU, per engine/tokenizer)
    grammar_cache_size: int = option(64, key="grammar.cache_size", min=1)
    # longest whitespace run between JSON tokens
    grammar_max_whitespace: int = option(2, key="grammar.max_whitespace", min=0)
    # token masks kept per compiled grammar
    grammar_mask_cache_size: int = option(1024, key="grammar.mask_cache_size", min=16)
    # near max_tokens, allow only tokens after which the document can still close in time
    # (backends whose matchers offer ``fill_mask_within``)
    grammar_close_within_max_tokens: bool = option(True, key="grammar.close_within_max_tokens")
    # compile time (the compiling thread's CPU ms) spent scanning the vocabulary from lexer
    # states beyond their starts, so that first masks find their scans ready
    grammar_warm_budget_ms: int = option(100, key="grammar.warm_budget_ms", min=0)

    # Admission and per-request limits.
    max_queued_requests: int = option(1024, key="limits.max_queued_requests", min=1, live=True)
    max_n: int = option(16, key="limits.max_n", min=1)
    max_top_logprobs: int = option(20, key="limits.max_top_logprobs", min=0, max=20)

    # KV-cache events (core.kv_events): the radix cache's blocks stored / removed / all cleared,
    # published over ZMQ as vLLM's KVEventBatch (msgpack) for llm-d's precise prefix-cache
    # scorer. block_size: tokens per reported block (also the block of cache_config_info).
    kv_events: bool = option(False, key="kv_events.enabled")
    kv_events_endpoint: str = option("tcp://*:5557", key="kv_events.endpoint", nonempty=True)
    kv_events_topic: str = option("", key="kv_events.topic")
    kv_events_block_size: int = option(16, key="kv_events.block_size", min=1)

    # Entry-point plugins to load (None: all installed ones) and never to load.
    plugins_allow: tuple[str, ...] | None = option(None, key="plugins.allow")
    plugins_block: tuple[str, ...] = option((), key="plugins.block")

    # Speculative decoding (radixd.core.speculative).
    # a drafter from the radixd_drafters hook (built in: "ngram", prompt lookup; "standalone", a
    # draft model; "eagle3", an EAGLE-3 draft head); "": off
    speculative_algorithm: str = option("", key="speculative.algorithm",
                                        allowed='"" (off) or the name of a loaded drafter')
    # the most tokens a request drafts in a step
    speculative_num_draft_tokens: int = option(4, key="speculative.num_draft_tokens", min=1, max=16)
    # token trees: a drafter may propose up to this many continuations of a node, verified
    # together in one forward (1: one chain; "ngram": distinct continuations, "standalone":
    # the first step's likeliest tokens, "eagle3": beams at every depth, as EAGLE grows them)
    speculative_eagle_topk: int = option(1, key="speculative.eagle_topk", min=1, max=8)
    # each request's draft length follows its acceptance (else always num_draft_tokens)
    speculative_adaptive: bool = option(True, key="speculative.adaptive")
    # with more requests decoding than this a step is compute-bound: nothing drafts (0: no limit)
    speculative_max_batch: int = option(8, key="speculative.max_batch", min=0)
    # "ngram": the longest and the shortest suffix of a request's tokens looked up in them
    speculative_ngram_max_match_window: int = option(4, key="speculative.ngram_max_match_window", min=1)
    speculative_ngram_min_match_window: int = option(1, key="speculative.ngram_min_match_window", min=1)
    # "standalone": the draft checkpoint (directory, .gguf or "default"; sharing the tokenizer)
    # and the slots of its KV region; "eagle3": the head's directory (SGLang's layout) and the
    # slots of its one-layer KV region (every running request's tokens since admission)
    speculative_draft_model_path: str = option("", key="speculative.draft_model_path")
    speculative_draft_kv_tokens: int = option(65536, key="speculative.draft_kv_tokens", min=16)

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_tiers()
        if self.speculative_ngram_min_match_window > self.speculative_ngram_max_match_window:
            raise ConfigError("speculative_ngram_min_match_window", self.speculative_ngram_min_match_window,
                              f"at most speculative_ngram_max_match_window ({self.speculative_ngram_max_match_window})")

    def _check_tiers(self) -> None:
        tiers = self.cache_tiers
        if isinstance(tiers, str) or not all(tiers):
            raise ConfigError("cache_tiers", tiers, "a list of tier names, e.g. ['host', 'disk']")
        if len(set(tiers)) != len(tiers):
            raise ConfigError("cache_tiers", list(tiers), "each tier at most once")
        if tiers and not self.radix_cache:
            raise ConfigError("cache_tiers", list(tiers), "an empty list while radix_cache is false (tiers extend the radix cache)")
        if tiers and self.tp_size != 1:
            raise ConfigError("cache_tiers", list(tiers), "an empty list while tp_size > 1 (tiers hold whole pages of one device)")
        opts = self.cache_tier_options
        if not all(isinstance(v, dict) for v in opts.values()):
            raise ConfigError("cache_tier_options", opts, "a table of tables, one per tier name")
        for name in opts:
            if name not in tiers:
                raise ConfigError(f"cache.{name}", "[...]", "options only for tiers listed in cache.tiers "
                                  f"({', '.join(tiers) or 'none'})")
        for name in tiers:
            if name in BUILTIN_TIERS:
                tier_options(name, opts.get(name, {}))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def file_options(cls) -> list[tuple[str, Any, Any]]:
        """(``section.key``, its type in the file, the field) of every option the file offers,
        in declaration order; the field's default is in the file's spelling."""
        hints = _hints(cls)
        out = []
        for f in fields(cls):
            if f.metadata.get("key") is None:
                continue
            hint = hints[f.name]
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            if default is None:
                default = file_unset(hint)
            if isinstance(default, tuple):
                default = list(default)
            out.append((f.metadata.get("key"), file_type(hint), option(default, **f.metadata)))
        return out

    @classmethod
    def check_file_value(cls, key: str, value: Any) -> None:
        """``check`` a value the file gives ``key`` (a ``section.key`` of ``file_options``)."""
        f = _by_file_key(cls)[key]
        hint = _hints(cls)[f.name]
        check(key, value, hint, f.metadata, unset=file_unset(hint))

    @classmethod
    def from_file(cls, value_of: Callable[[str], Any], **engine_only: Any) -> EngineConfig:
        """The config of the file's values (``value_of("memory.kv_cache_bytes")``), each
        already checked by ``check_file_value``; a ``ConfigError`` of the cross-option checks
        names the file's key."""
        kw: dict[str, Any] = dict(engine_only)
        hints = _hints(cls)
        for key, f in _by_file_key(cls).items():
            value, hint = value_of(key), hints[f.name]
            if file_unset(hint) is not MISSING and value == file_unset(hint):
                value = None
            elif isinstance(value, list):
                value = tuple(value)
            elif file_type(hint) is float:
                value = float(value)
            kw[f.name] = value
        try:
            return cls(**kw)
        except ConfigError as exc:
            f = next((f for f in fields(cls) if f.name == exc.key), None)
            if f is None or f.metadata.get("key") is None:
                raise
            raise ConfigError(f.metadata.get("key"), exc.value, exc.allowed) from exc


def _by_file_key(cls: type) -> dict[str, Any]:
    return {f.metadata.get("key"): f for f in fields(cls) if f.metadata.get("key") is not None}


@dataclass(frozen=True)
class HostTierOptions:
    """``[cache.host]``: the host-memory tier (its own check also wants one page at least)."""

    max_bytes: int = option(4 << 30, min=1)


@dataclass(frozen=True)
class DiskTierOptions:
    """``[cache.disk]``: the disk tier."""

    path: str = option("", required=True, allowed="a directory for the disk tier's page files")
    max_bytes: int = option(16 << 30, min=1)


BUILTIN_TIERS: dict[str, type] = {"host": HostTierOptions, "disk": DiskTierOptions}


def tier_options(name: str, options: dict[str, Any]) -> Any:
    """The options table of the built-in tier ``name``, in use: checked (``cache.NAME.KEY``
    in errors, required options given), as its dataclass."""
    cls = BUILTIN_TIERS[name]
    known = {f.name: f for f in fields(cls)}
    hints = _hints(cls)
    for key, value in options.items():
        if key not in known:
            raise ConfigError(f"cache.{name}.{key}", value, "keys " + ", ".join(known))
        check(f"cache.{name}.{key}", value, hints[key], known[key].metadata)
    for key, f in known.items():
        if f.metadata.get("required") and not options.get(key):
            raise ConfigError(f"cache.{name}.{key}", options.get(key, f.default),
                              f'{f.metadata["allowed"]} (cache.tiers lists "{name}")')
    return cls(**options)
