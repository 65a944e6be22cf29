"""Engine configuration: a frozen dataclass checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from radixd.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
WRITE_POLICIES = ("write_back", "write_through", "write_through_hits")
ROUTING_POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to serve one model.

    ``model`` is a Hugging Face checkpoint directory (config.json + safetensors), a ``.gguf``
    file, or ``"default"`` for the bundled SmolLM2-135M-Instruct (converted once into
    ``cache_dir``).
    """

    model: str = "default"
    tokenizer: str | None = None  # a directory; "none": token ids only, no text
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    cache_dir: str | None = None
    # "dummy": random weights of the checkpoint's shape, no weight files (benchmarks).
    load_format: str = "auto"

    # KV memory. ``kv_cache_bytes`` wins over ``kv_cache_tokens`` when both are set.
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    max_context_len: int | None = None
    # On CUDA without an explicit size: share of the free memory after the weights.
    mem_fraction: float = 0.85
    # Capture decode steps as CUDA graphs (batch-size buckets up to max_running_requests).
    cuda_graphs: bool = True
    # Decode requests that share a cached prefix read its KV once for all of them (two-level
    # "cascade" attention; the triton backend).
    cascade_attention: bool = True
    # Optional kernels (triton_ops.KernelChoice; benchmarks compare both ways): one-row
    # projections with the next element-wise step in the GEMV's epilogue, and the few-row
    # projection kernel where it was measured faster than cuBLAS.
    fuse_one_row: bool = True
    rows_kernel: bool = True

    # Radix cache.
    radix_cache: bool = True
    # Lower cache tiers, fastest first (names from the radixd_cache_tiers hook: "host",
    # "disk", plugins' tiers); empty: the pool only.
    cache_tiers: tuple[str, ...] = ()
    # Tokens per page stored in the tiers (only whole pages are stored).
    cache_page_tokens: int = 16
    # When pages go down: "write_back" (on eviction from the pool), "write_through" (when a
    # request leaves), "write_through_hits" (when it leaves, for prefixes hit cache_write_hits times).
    cache_write_policy: str = "write_back"
    cache_write_hits: int = 2
    # Prefetch pages of arriving requests from slow tiers into the first (memory) tier.
    cache_prefetch: bool = True
    # Each tier's options, by tier name (the [cache.NAME] tables of radixd.toml).
    cache_tier_options: dict = field(default_factory=dict)

    # Several devices: ``dp_size`` replicas (each a model copy, KV pool, radix tree and
    # scheduler), each split over ``tp_size`` devices (heads and MLP columns per device).
    dp_size: int = 1
    tp_size: int = 1
    # tp on CUDA: sum small partials (decode steps) with radixd's one-shot kernel over peer-to-
    # peer memory where the GPUs can address each other; NCCL for the rest (and when off).
    peer_all_reduce: bool = True
    # Which replica serves a request: "cache_aware" (the longest cached prefix unless that
    # replica has more than ``routing_balance_threshold`` requests over the least-loaded one
    # and more than ``routing_balance_ratio`` times its load; see router.py) or "round_robin".
    routing: str = "cache_aware"
    routing_balance_threshold: int = 16
    routing_balance_ratio: float = 1.25

    # Scheduler.
    policy: str = "lpm"
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    max_queued_requests: int = 1024
    lpm_dedup_min_tokens: int = 32
    # Launch step N+1 before reading step N's picks (the device never waits for the host).
    overlap_schedule: bool = True
    stream_interval: int = 1  # tokens per streamed update of a request (1: every token)
    # While running: start-up objects frozen out of the garbage collector's walks, and its
    # youngest generation's threshold raised to at least this (0: Python's); see gc_control.
    gc_freeze: bool = True
    gc_threshold: int = 10000
    # Fraction of each running request's remaining max_new_tokens kept free when admitting.
    schedule_conservativeness: float = 0.3

    # Sampling.
    max_n: int = 16
    max_top_logprobs: int = 20
    seed: int = 0

    # Structured generation (radixd.grammars).
    grammar_backend: str = "radixd"          # a backend from the radixd_grammar_backends hook
    grammar_compile_timeout: float = 10.0    # seconds; a slower compile fails its request (400)
    grammar_compile_workers: int = 2         # threads compiling grammars off the event loop
    # a new grammar first compiles in a worker process under this memory limit (and the
    # time limit), killed if it explodes; 0: no such trial (threads only)
    grammar_compile_memory_mb: int = 1024
    grammar_cache_size: int = 64            # compiled grammars kept (LRU, per engine/tokenizer)
    grammar_max_whitespace: int = 2          # longest whitespace run between JSON tokens
    grammar_mask_cache_size: int = 1024      # token masks kept per compiled grammar
    # near max_tokens, allow only tokens after which the document can still close in time
    # (backends whose matchers offer ``fill_mask_within``)
    grammar_close_within_max_tokens: bool = True
    # compile time (the compiling thread's CPU ms) spent scanning the vocabulary from lexer
    # states beyond their starts, so that first masks find their scans ready
    grammar_warm_budget_ms: int = 100

    plugins_allow: tuple[str, ...] | None = None
    plugins_block: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        _one_of("routing", self.routing, ROUTING_POLICIES)
        _int_at_least("dp_size", self.dp_size, 1)
        _int_at_least("tp_size", self.tp_size, 1)
        _int_at_least("routing_balance_threshold", self.routing_balance_threshold, 0)
        if (isinstance(self.routing_balance_ratio, bool) or not isinstance(self.routing_balance_ratio, int | float)
                or not self.routing_balance_ratio >= 1.0):
            raise ConfigError("routing_balance_ratio", self.routing_balance_ratio, "a number >= 1")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a checkpoint directory, a .gguf file or 'default'")
        if self.kv_cache_bytes is not None:
            _int_at_least("kv_cache_bytes", self.kv_cache_bytes, 1)
        if self.kv_cache_tokens is not None:
            _int_at_least("kv_cache_tokens", self.kv_cache_tokens, 2)
        if self.max_context_len is not None:
            _int_at_least("max_context_len", self.max_context_len, 2)
        _int_at_least("max_running_requests", self.max_running_requests, 1)
        _int_at_least("max_prefill_tokens", self.max_prefill_tokens, 1)
        _int_at_least("chunked_prefill_size", self.chunked_prefill_size, 1)
        _int_at_least("max_queued_requests", self.max_queued_requests, 1)
        _int_at_least("lpm_dedup_min_tokens", self.lpm_dedup_min_tokens, 1)
        _int_at_least("max_n", self.max_n, 1)
        _int_at_least("max_top_logprobs", self.max_top_logprobs, 0)
        if (
            isinstance(self.schedule_conservativeness, bool)
            or not isinstance(self.schedule_conservativeness, int | float)
            or not 0.0 <= self.schedule_conservativeness <= 1.0
        ):
            raise ConfigError("schedule_conservativeness", self.schedule_conservativeness, "a number in [0, 1]")
        if isinstance(self.mem_fraction, bool) or not isinstance(self.mem_fraction, int | float) or not 0.0 < self.mem_fraction < 1.0:
            raise ConfigError("mem_fraction", self.mem_fraction, "a number in (0, 1)")
        if not isinstance(self.overlap_schedule, bool):
            raise ConfigError("overlap_schedule", self.overlap_schedule, "true or false")
        if not isinstance(self.gc_freeze, bool):
            raise ConfigError("gc_freeze", self.gc_freeze, "true or false")
        if isinstance(self.gc_threshold, bool) or not isinstance(self.gc_threshold, int) or self.gc_threshold < 0:
            raise ConfigError("gc_threshold", self.gc_threshold, "an integer >= 0 (0: Python's own)")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ConfigError("stream_interval", self.stream_interval, "an integer >= 1")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError("cuda_graphs", self.cuda_graphs, "true or false")
        if not isinstance(self.cascade_attention, bool):
            raise ConfigError("cascade_attention", self.cascade_attention, "true or false")
        if not isinstance(self.fuse_one_row, bool):
            raise ConfigError("fuse_one_row", self.fuse_one_row, "true or false")
        if not isinstance(self.rows_kernel, bool):
            raise ConfigError("rows_kernel", self.rows_kernel, "true or false")
        if not isinstance(self.radix_cache, bool):
            raise ConfigError("radix_cache", self.radix_cache, "true or false")
        self._check_tiers()
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError("policy", self.policy, "the name of a loaded scheduling policy")
        if not isinstance(self.grammar_backend, str) or not self.grammar_backend:
            raise ConfigError("grammar_backend", self.grammar_backend, "the name of a loaded grammar backend")
        if (isinstance(self.grammar_compile_timeout, bool) or not isinstance(self.grammar_compile_timeout, int | float)
                or not self.grammar_compile_timeout > 0):
            raise ConfigError("grammar_compile_timeout", self.grammar_compile_timeout, "a number of seconds > 0")
        _int_at_least("grammar_compile_workers", self.grammar_compile_workers, 1)
        _int_at_least("grammar_compile_memory_mb", self.grammar_compile_memory_mb, 0)
        _int_at_least("grammar_cache_size", self.grammar_cache_size, 1)
        _int_at_least("grammar_max_whitespace", self.grammar_max_whitespace, 0)
        _int_at_least("grammar_mask_cache_size", self.grammar_mask_cache_size, 16)
        if not isinstance(self.grammar_close_within_max_tokens, bool):
            raise ConfigError("grammar_close_within_max_tokens", self.grammar_close_within_max_tokens, "true or false")
        _int_at_least("grammar_warm_budget_ms", self.grammar_warm_budget_ms, 0)
        if not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "an integer")

    def _check_tiers(self) -> None:
        tiers = self.cache_tiers
        if isinstance(tiers, str) or not isinstance(tiers, tuple | list) or not all(isinstance(t, str) and t for t in tiers):
            raise ConfigError("cache_tiers", tiers, "a list of tier names, e.g. ['host', 'disk']")
        if len(set(tiers)) != len(tiers):
            raise ConfigError("cache_tiers", list(tiers), "each tier at most once")
        if tiers and not self.radix_cache:
            raise ConfigError("cache_tiers", list(tiers), "an empty list while radix_cache is false (tiers extend the radix cache)")
        if tiers and self.tp_size != 1:
            raise ConfigError("cache_tiers", list(tiers), "an empty list while tp_size > 1 (tiers hold whole pages of one device)")
        _int_at_least("cache_page_tokens", self.cache_page_tokens, 1)
        _one_of("cache_write_policy", self.cache_write_policy, WRITE_POLICIES)
        _int_at_least("cache_write_hits", self.cache_write_hits, 1)
        if not isinstance(self.cache_prefetch, bool):
            raise ConfigError("cache_prefetch", self.cache_prefetch, "true or false")
        opts = self.cache_tier_options
        if not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values()):
            raise ConfigError("cache_tier_options", opts, "a table of tables, one per tier name")
        for name in opts:
            if name not in tiers:
                raise ConfigError(f"cache.{name}", "[...]", "options only for tiers listed in cache.tiers "
                                  f"({', '.join(tiers) or 'none'})")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "one of " + ", ".join(repr(a) for a in allowed))


def _int_at_least(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
