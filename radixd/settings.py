"""The daemon's configuration file (``radixd.toml``): sections of frozen dataclasses.

Every key has a type, a default and (where it matters) a range or a set of choices, kept in
the field's metadata; ``load_settings`` refuses unknown sections and keys, wrong types and
out-of-range values with a ``ConfigError`` naming the key, the value and what is allowed.
``radixd.toml`` in the repository documents every key; a test keeps it, these dataclasses
and ``man/radixd.toml.5`` in step.
"""

from __future__ import annotations

import os
import stat
import tomllib
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from radixd.core.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    ROUTING_POLICIES,
    WRITE_POLICIES,
    EngineConfig,
)
from radixd.core.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
CHAT_SPECIAL_TOKENS = ("refuse", "as_text", "allow")
PLUGIN_ON_ERROR = ("fail", "disable")


def _f(default: Any, *, min: float | None = None, max: float | None = None, choices: tuple | None = None,
       live: bool = False) -> Any:
    """A field with validation metadata; ``live`` keys are re-read on SIGHUP."""
    meta = {"min": min, "max": max, "choices": choices, "live": live}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelSection:
    path: str = _f("default")
    tokenizer: str = _f("")
    served_name: str = _f("")
    dtype: str = _f("auto", choices=DTYPES)
    device: str = _f("auto", choices=DEVICES)
    attention_backend: str = _f("auto", choices=ATTENTION_BACKENDS)
    cuda_graphs: bool = _f(True)
    cascade_attention: bool = _f(True)
    cache_dir: str = _f("")
    max_context_len: int = _f(0, min=0)


@dataclass(frozen=True)
class ServerSection:
    host: str = _f("127.0.0.1")
    port: int = _f(8000, min=0, max=65535)
    max_body_bytes: int = _f(1_048_576, min=1024, live=True)
    drain_timeout_s: float = _f(30.0, min=0.0)
    health_timeout_s: float = _f(10.0, min=0.1, live=True)
    watchdog: bool = _f(True)
    stall_timeout_s: float = _f(60.0, min=0.0, live=True)
    send_timeout_s: float = _f(30.0, min=0.1, live=True)
    stream_buffer: int = _f(256, min=1, live=True)
    cors_origins: list[str] = _f([])


@dataclass(frozen=True)
class MemorySection:
    kv_cache_bytes: int = _f(0, min=0)
    kv_cache_tokens: int = _f(0, min=0)
    mem_fraction: float = _f(0.85, min=0.05, max=0.98)


@dataclass(frozen=True)
class CacheSection:
    radix: bool = _f(True)
    tiers: list[str] = _f([])
    page_tokens: int = _f(16, min=1)
    write_policy: str = _f("write_back", choices=WRITE_POLICIES)
    write_hits: int = _f(2, min=1)
    prefetch: bool = _f(True)


@dataclass(frozen=True)
class HostTierSection:
    max_bytes: int = _f(4 << 30, min=1)


@dataclass(frozen=True)
class DiskTierSection:
    path: str = _f("")
    max_bytes: int = _f(16 << 30, min=1)


@dataclass(frozen=True)
class SchedulerSection:
    policy: str = _f("lpm")
    max_running_requests: int = _f(64, min=1)
    max_prefill_tokens: int = _f(4096, min=1)
    chunked_prefill_size: int = _f(2048, min=1)
    schedule_conservativeness: float = _f(0.3, min=0.0, max=1.0)
    overlap: bool = _f(True)
    stream_interval: int = _f(1, min=1)
    seed: int = _f(0, min=0)
    gc_freeze: bool = _f(True)
    gc_threshold: int = _f(10000, min=0)


@dataclass(frozen=True)
class ParallelSection:
    dp_size: int = _f(1, min=1)
    tp_size: int = _f(1, min=1)
    peer_all_reduce: bool = _f(True)
    routing: str = _f("cache_aware", choices=ROUTING_POLICIES)
    routing_balance_threshold: int = _f(16, min=0)
    routing_balance_ratio: float = _f(1.25, min=1.0)


@dataclass(frozen=True)
class GrammarSection:
    backend: str = _f("radixd")
    compile_timeout: float = _f(10.0, min=0.001)
    compile_workers: int = _f(2, min=1)
    compile_memory_mb: int = _f(1024, min=0)
    cache_size: int = _f(64, min=1)
    max_whitespace: int = _f(2, min=0)
    mask_cache_size: int = _f(1024, min=16)
    close_within_max_tokens: bool = _f(True)
    warm_budget_ms: int = _f(100, min=0)


@dataclass(frozen=True)
class LimitsSection:
    max_queued_requests: int = _f(1024, min=1, live=True)
    max_n: int = _f(16, min=1)
    max_top_logprobs: int = _f(20, min=0, max=20)
    default_max_tokens: int = _f(256, min=1, live=True)
    max_stop_sequences: int = _f(16, min=0, live=True)
    chat_special_tokens: str = _f("refuse", choices=CHAT_SPECIAL_TOKENS, live=True)


@dataclass(frozen=True)
class LoggingSection:
    level: str = _f("info", choices=LOG_LEVELS, live=True)
    format: str = _f("auto", choices=LOG_FORMATS)
    access_log: bool = _f(True, live=True)
    log_prompts: bool = _f(False, live=True)


@dataclass(frozen=True)
class PluginsSection:
    allow: list[str] = _f([])
    block: list[str] = _f([])
    entry_points: bool = _f(True)
    on_error: str = _f("fail", choices=PLUGIN_ON_ERROR)
    hook_timeout_s: float = _f(5.0, min=0.0)


@dataclass(frozen=True)
class AuthSection:
    api_keys: list[str] = _f([])
    api_keys_file: str = _f("")


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "server": ServerSection,
    "memory": MemorySection,
    "cache": CacheSection,
    "cache.host": HostTierSection,
    "cache.disk": DiskTierSection,
    "scheduler": SchedulerSection,
    "parallel": ParallelSection,
    "grammar": GrammarSection,
    "limits": LimitsSection,
    "logging": LoggingSection,
    "plugins": PluginsSection,
    "auth": AuthSection,
}


@dataclass(frozen=True)
class Settings:
    model: ModelSection = field(default_factory=ModelSection)
    server: ServerSection = field(default_factory=ServerSection)
    memory: MemorySection = field(default_factory=MemorySection)
    cache: CacheSection = field(default_factory=CacheSection)
    cache_host: HostTierSection = field(default_factory=HostTierSection)
    cache_disk: DiskTierSection = field(default_factory=DiskTierSection)
    # [cache.NAME] tables of tiers that plugins provide, checked by the tier itself
    plugin_tiers: dict = field(default_factory=dict)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    grammar: GrammarSection = field(default_factory=GrammarSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    plugins: PluginsSection = field(default_factory=PluginsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    source: str | None = None

    def engine_config(self) -> EngineConfig:
        m, mem, s, lim = self.model, self.memory, self.scheduler, self.limits
        return EngineConfig(
            model=m.path,
            tokenizer=m.tokenizer or None,
            dtype=m.dtype,
            device=m.device,
            attention_backend=m.attention_backend,
            cuda_graphs=m.cuda_graphs,
            cascade_attention=m.cascade_attention,
            mem_fraction=mem.mem_fraction,
            cache_dir=m.cache_dir or None,
            kv_cache_bytes=mem.kv_cache_bytes or None,
            kv_cache_tokens=mem.kv_cache_tokens or None,
            max_context_len=m.max_context_len or None,
            radix_cache=self.cache.radix,
            cache_tiers=tuple(self.cache.tiers),
            cache_page_tokens=self.cache.page_tokens,
            cache_write_policy=self.cache.write_policy,
            cache_write_hits=self.cache.write_hits,
            cache_prefetch=self.cache.prefetch,
            cache_tier_options=self.tier_options(),
            policy=s.policy,
            max_running_requests=s.max_running_requests,
            max_prefill_tokens=s.max_prefill_tokens,
            chunked_prefill_size=s.chunked_prefill_size,
            schedule_conservativeness=s.schedule_conservativeness,
            overlap_schedule=s.overlap,
            stream_interval=s.stream_interval,
            gc_freeze=s.gc_freeze,
            gc_threshold=s.gc_threshold,
            seed=s.seed,
            dp_size=self.parallel.dp_size,
            tp_size=self.parallel.tp_size,
            peer_all_reduce=self.parallel.peer_all_reduce,
            routing=self.parallel.routing,
            routing_balance_threshold=self.parallel.routing_balance_threshold,
            routing_balance_ratio=float(self.parallel.routing_balance_ratio),
            max_queued_requests=lim.max_queued_requests,
            max_n=lim.max_n,
            max_top_logprobs=lim.max_top_logprobs,
            grammar_backend=self.grammar.backend,
            grammar_compile_timeout=float(self.grammar.compile_timeout),
            grammar_compile_workers=self.grammar.compile_workers,
            grammar_compile_memory_mb=self.grammar.compile_memory_mb,
            grammar_cache_size=self.grammar.cache_size,
            grammar_max_whitespace=self.grammar.max_whitespace,
            grammar_mask_cache_size=self.grammar.mask_cache_size,
            grammar_close_within_max_tokens=self.grammar.close_within_max_tokens,
            grammar_warm_budget_ms=self.grammar.warm_budget_ms,
            plugins_allow=tuple(self.plugins.allow) or None,
            plugins_block=tuple(self.plugins.block),
        )

    def tier_options(self) -> dict[str, dict]:
        """Options of each tier in ``cache.tiers``: built-in sections, plugins' tables."""
        builtin = {"host": self.cache_host, "disk": self.cache_disk}
        out = {name: dict(opts) for name, opts in self.plugin_tiers.items()}
        for name in self.cache.tiers:
            if name in builtin:
                out[name] = {f.name: getattr(builtin[name], f.name) for f in fields(builtin[name])}
        return out

    def api_keys(self) -> list[str]:
        """Keys from ``auth.api_keys`` plus one per line of ``auth.api_keys_file``."""
        keys = list(self.auth.api_keys)
        if self.auth.api_keys_file:
            keys += read_keys_file(Path(self.auth.api_keys_file))
        return keys


def read_keys_file(path: Path) -> list[str]:
    """The keys of ``auth.api_keys_file``: a file only its owner may read (no group or other
    permission bits), holding at least one key. Refused otherwise: a key file others can read
    leaks the keys; an empty one would silently turn authentication off."""
    key = "auth.api_keys_file"
    try:
        with open(path) as fh:
            mode = os.fstat(fh.fileno()).st_mode
            text = fh.read()
    except OSError as exc:
        raise ConfigError(key, str(path), f"a readable file ({exc.strerror})") from exc
    if mode & 0o077:
        raise ConfigError(key, str(path), f"a file readable only by its owner (chmod 600); it is mode "
                                          f"{stat.S_IMODE(mode):04o}, open to its group or others")
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(key, str(path), "a file with at least one key (one per line)")
    return keys


def all_keys() -> list[str]:
    """Every ``section.key`` the file may contain."""
    return [f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in fields(cls)]


def live_keys() -> list[str]:
    return [f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in fields(cls) if f.metadata.get("live")]


def load_settings(path: str | Path | None) -> Settings:
    """Read and check a TOML file (``None``: all defaults)."""
    if path is None:
        return Settings()
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError("--config", str(path), "an existing TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", str(path), f"valid TOML ({exc})") from exc
    return settings_from_dict(data, source=str(path))


def settings_from_dict(data: dict[str, Any], *, source: str | None = None) -> Settings:
    sections: dict[str, Any] = {}
    data = dict(data)
    cache = data.get("cache")
    if isinstance(cache, dict):  # [cache.NAME] tables: a built-in tier's section or a plugin's
        data["cache"] = {k: v for k, v in cache.items() if not isinstance(v, dict)}
        plugin_tiers = {}
        for sub, table in cache.items():
            if not isinstance(table, dict):
                continue
            if f"cache.{sub}" in SECTIONS:
                data[f"cache.{sub}"] = table
            else:
                plugin_tiers[sub] = table
        if plugin_tiers:
            sections["plugin_tiers"] = plugin_tiers
    for name, table in data.items():
        cls = SECTIONS.get(name)
        if cls is None:
            raise ConfigError(name, table if not isinstance(table, dict) else "[...]",
                              "sections " + ", ".join(f"[{s}]" for s in SECTIONS))
        if not isinstance(table, dict):
            raise ConfigError(name, table, f"a [{name}] table")
        sections[name.replace(".", "_")] = _section(name, cls, table)
    settings = Settings(**sections, source=source)
    engine_check(settings)
    return settings


def engine_check(settings: Settings) -> None:
    """Cross-key checks the engine itself makes, reported with the file's key names."""
    if "disk" in settings.cache.tiers and not settings.cache_disk.path:
        raise ConfigError("cache.disk.path", "", "a directory for the disk tier's page files (cache.tiers lists \"disk\")")
    try:
        settings.engine_config()
    except ConfigError as exc:
        raise ConfigError(_file_key(exc.key), exc.value, exc.allowed) from exc


ENGINE_TO_FILE = {"radix_cache": "cache.radix", "cache_tiers": "cache.tiers", "cache_page_tokens": "cache.page_tokens",
                  "cache_write_policy": "cache.write_policy", "cache_write_hits": "cache.write_hits",
                  "cache_prefetch": "cache.prefetch"}


def _file_key(engine_key: str) -> str:
    if engine_key in ENGINE_TO_FILE:
        return ENGINE_TO_FILE[engine_key]
    for sec, cls in SECTIONS.items():
        for f in fields(cls):
            if f.name == engine_key:
                return f"{sec}.{f.name}"
    return engine_key


def _section(name: str, cls: type, table: dict[str, Any]):
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        full = f"{name}.{key}"
        f = known.get(key)
        if f is None:
            raise ConfigError(full, value, "keys " + ", ".join(known))
        _check(full, value, hints[key], f.metadata)
        values[key] = value
    return cls(**values)


def _check(key: str, value: Any, hint: Any, meta: dict) -> None:
    origin = typing.get_origin(hint)
    if origin in (list, types.GenericAlias) or hint is list or origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, value, "a list of strings")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
        return
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a new field type needs a branch here
        raise TypeError(f"settings: no check for {hint!r}")
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if not ok:
        raise ConfigError(key, value, _allowed(hint, lo, hi, choices))
    if choices is not None and value not in choices:
        raise ConfigError(key, value, _allowed(hint, lo, hi, choices))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(key, value, _allowed(hint, lo, hi, choices))


def _allowed(hint, lo, hi, choices) -> str:
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    kind = {int: "an integer", float: "a number", str: "a string"}[hint]
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"{kind} >= {lo}"
    return kind


def section_of(settings: Settings, section: str):
    """The dataclass of ``section`` (``"cache.host"`` -> ``settings.cache_host``)."""
    return getattr(settings, section.replace(".", "_"))


def default_of(section: str, key: str) -> Any:
    f = next(f for f in fields(SECTIONS[section]) if f.name == key)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
