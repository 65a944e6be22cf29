"""The daemon's configuration file (``radixd.toml``): sections of frozen dataclasses.

The engine's sections ([model], [memory], [cache], [cache.host], [cache.disk], [scheduler],
[parallel], [grammar], [limits], [plugins]) are built from ``radixd.core.config``'s
declaration (each ``EngineConfig`` option names its key); this module adds the daemon's own
sections ([server], [logging], [auth]) and the daemon's keys in the engine's sections
(``model.served_name``, the request limits, the plugin manager's switches). Every key has a
type, a default and (where it matters) a range or a set of choices in its field's metadata,
checked by ``radixd.core.config.check``: ``load_settings`` refuses unknown sections and keys,
wrong types and out-of-range values with a ``ConfigError`` naming the key, the value and
what is allowed. ``radixd.toml`` in the repository documents every key; a test keeps it,
these dataclasses and ``man/radixd.toml.5`` in step.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
import typing
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from radixd.core.config import BUILTIN_TIERS, EngineConfig, check, option
from radixd.core.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
CHAT_SPECIAL_TOKENS = ("refuse", "as_text", "allow")
PLUGIN_ON_ERROR = ("fail", "disable")
DISAGG_MODES = ("off", "prefill", "decode")


# ------------------------------------------------------------ the daemon's own keys


@dataclass(frozen=True)
class ServerSection:
    host: str = option("127.0.0.1")
    port: int = option(8000, min=0, max=65535)
    max_body_bytes: int = option(1_048_576, min=1024, live=True)
    drain_timeout_s: float = option(30.0, min=0.0)
    health_timeout_s: float = option(10.0, min=0.1, live=True)
    watchdog: bool = option(True)
    stall_timeout_s: float = option(60.0, min=0.0, live=True)
    send_timeout_s: float = option(30.0, min=0.1, live=True)
    stream_buffer: int = option(256, min=1, live=True)
    sse_ping_s: float = option(0.0, min=0.0, live=True)
    cors_origins: list[str] = option([])
    dashboard: bool = option(False)  # GET /dashboard and its SSE feed /dashboard/events


@dataclass(frozen=True)
class LoggingSection:
    level: str = option("info", choices=LOG_LEVELS, live=True)
    format: str = option("auto", choices=LOG_FORMATS)
    access_log: bool = option(True, live=True)
    log_prompts: bool = option(False, live=True)


@dataclass(frozen=True)
class AuthSection:
    api_keys: list[str] = option([])
    api_keys_file: str = option("")


@dataclass(frozen=True)
class DisaggregationSection:  # prefill/decode disaggregation on SGLang's protocol (server/disagg.py)
    mode: str = option("off", choices=DISAGG_MODES)
    bootstrap_port: int = option(8998, min=1, max=65535)  # the prefill role's bootstrap server
    transfer_backend: str = option("mooncake", nonempty=True)  # a radixd_kv_transfer_backends name
    ib_device: str = option("")  # Mooncake's RDMA device; empty: TCP
    bootstrap_timeout_s: float = option(30.0, min=0.1)  # a request's peer must show up within this
    transfer_timeout_s: float = option(30.0, min=0.1)  # a request's KV must arrive within this (prefill included)
    heartbeat_interval_s: float = option(1.0, min=0.05)  # a silent peer for 3 of these has failed


@dataclass(frozen=True)
class _ModelKeys:  # [model] keys of the HTTP layer
    served_name: str = option("")
    # "auto", "none" or a parser's name; the names come from plugins, checked where they load
    reasoning_parser: str = option("auto")
    # "auto": picked by the chat template's markup; "none": no tool calling; else a parser's
    # name (the radixd_tool_parsers hook's table, checked when the plugins are loaded)
    tool_parser: str = option("auto", nonempty=True, allowed="auto, none or the name of a loaded tool parser")
    tool_grammar: bool = option(True)  # tool calls generated under their schemas' grammar


@dataclass(frozen=True)
class _LimitsKeys:  # [limits] keys the request parsers apply
    default_max_tokens: int = option(0, min=0, live=True)
    max_stop_sequences: int = option(16, min=0, live=True)
    chat_special_tokens: str = option("refuse", choices=CHAT_SPECIAL_TOKENS, live=True)


@dataclass(frozen=True)
class _PluginsKeys:  # [plugins] keys of the plugin manager and the hook guard
    entry_points: bool = option(True)
    on_error: str = option("fail", choices=PLUGIN_ON_ERROR)
    hook_timeout_s: float = option(5.0, min=0.0)


# ------------------------------------------------------------ the engine's sections


def _engine_section(name: str, daemon: type | None = None) -> type:
    """The dataclass of the file's section ``[name]``: the engine's options of that section
    (from ``EngineConfig``'s declaration) followed by the daemon's ``daemon`` keys."""
    specs = [(key.rsplit(".", 1)[1], hint, f) for key, hint, f in EngineConfig.file_options()
             if key.rsplit(".", 1)[0] == name]
    if daemon is not None:
        hints = typing.get_type_hints(daemon)
        specs += [(f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory,
                                                 metadata=f.metadata)) for f in fields(daemon)]
    cls_name = "".join(part.capitalize() for part in name.split(".")) + "Section"
    cls = make_dataclass(cls_name, specs, frozen=True)
    cls.__module__ = __name__
    return cls


ModelSection = _engine_section("model", _ModelKeys)
MemorySection = _engine_section("memory")
CacheSection = _engine_section("cache")
HostTierSection = BUILTIN_TIERS["host"]  # [cache.host], [cache.disk]: core's declaration of
DiskTierSection = BUILTIN_TIERS["disk"]  # the built-in tiers' options
SchedulerSection = _engine_section("scheduler")
ParallelSection = _engine_section("parallel")
GrammarSection = _engine_section("grammar")
LimitsSection = _engine_section("limits", _LimitsKeys)
PluginsSection = _engine_section("plugins", _PluginsKeys)
SpeculativeSection = _engine_section("speculative")
KvEventsSection = _engine_section("kv_events")


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
    "disaggregation": DisaggregationSection,
    "speculative": SpeculativeSection,
    "kv_events": KvEventsSection,
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
    disaggregation: DisaggregationSection = field(default_factory=DisaggregationSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    kv_events: KvEventsSection = field(default_factory=KvEventsSection)
    source: str | None = None

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: its options read from their sections, by key."""
        def value_of(key: str) -> Any:
            sec, name = key.rsplit(".", 1)
            return getattr(section_of(self, sec), name)

        return EngineConfig.from_file(value_of, cache_tier_options=self.tier_options())

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


class ConfigErrors(ConfigError):
    """Every error of one file, each a ``ConfigError``; ``str`` gives one per line."""

    def __init__(self, errors: list[ConfigError]):
        first = errors[0]
        super().__init__(first.key, first.value, first.allowed)
        self.errors = errors
        self.args = ("\n".join(str(e) for e in errors),)


def load_settings(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Settings:
    """Read and check a TOML file (``None``: all defaults), with ``overrides``
    (``{"section.key": value}``, the launch flags) laid over it. Raises ``ConfigErrors``
    holding every error found, or one ``ConfigError`` for a file that cannot be read."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError("--config", str(path), "an existing TOML file") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", str(path), f"valid TOML: {path}:{toml_error_where(exc)}") from exc
    for key, value in (overrides or {}).items():
        sec, name = key.rsplit(".", 1)
        table = data
        for part in sec.split("."):
            table = table.setdefault(part, {})
        table[name] = value
    if path is None and not overrides:
        return Settings()
    return settings_from_dict(data, source=None if path is None else str(path))


def toml_error_where(exc: tomllib.TOMLDecodeError) -> str:
    """``LINE:COLUMN: what`` of a TOML syntax error (tomllib puts the place in its message)."""
    m = re.search(r"^(.*) \(at line (\d+), column (\d+)\)$", str(exc))
    if m is None:
        return str(exc)
    return f"{m.group(2)}:{m.group(3)}: {m.group(1)}"


def check_key(key: str, value: Any) -> None:
    """Check one ``section.key`` value as the file's would be (``ConfigError`` if refused)."""
    sec, name = key.rsplit(".", 1)
    _section(sec, SECTIONS[sec], {name: value})


def settings_from_dict(data: dict[str, Any], *, source: str | None = None) -> Settings:
    sections: dict[str, Any] = {}
    errors: list[ConfigError] = []
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
            errors.append(ConfigError(name, table if not isinstance(table, dict) else "[...]",
                                      "sections " + ", ".join(f"[{s}]" for s in SECTIONS)))
        elif not isinstance(table, dict):
            errors.append(ConfigError(name, table, f"a [{name}] table"))
        else:
            try:
                sections[name.replace(".", "_")] = _section(name, cls, table)
            except ConfigErrors as exc:
                errors += exc.errors
    if errors:
        raise ConfigErrors(errors)
    settings = Settings(**sections, source=source)
    try:
        settings.engine_config()  # the engine's cross-option checks, with the file's key names
    except ConfigError as exc:
        raise ConfigErrors([exc]) from exc
    return settings


def _section(name: str, cls: type, table: dict[str, Any]):
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    errors: list[ConfigError] = []
    for key, value in table.items():
        full = f"{name}.{key}"
        f = known.get(key)
        try:
            if f is None:
                raise ConfigError(full, value, "keys " + ", ".join(known))
            if f.metadata.get("key") is not None:
                EngineConfig.check_file_value(full, value)
            else:
                check(full, value, hints[key], f.metadata)
        except ConfigError as exc:
            errors.append(exc)
            continue
        values[key] = value
    if errors:
        raise ConfigErrors(errors)
    return cls(**values)


def render_settings(settings: Settings, notes: dict[str, str | None] | None = None) -> str:
    """Every key of ``settings`` as TOML (API keys masked); ``notes``: a comment per key
    (where a launch flag set it)."""
    notes = notes or {}
    out = []
    for sec, cls in SECTIONS.items():
        out.append(f"[{sec}]")
        for f in fields(cls):
            value = getattr(section_of(settings, sec), f.name)
            if sec == "auth" and f.name == "api_keys":
                value = ["***"] * len(value)
            note = notes.get(f"{sec}.{f.name}")
            out.append(f"{f.name} = {json.dumps(value)}" + (f"  # {note}" if note else ""))
        out.append("")
    return "\n".join(out)


def section_of(settings: Settings, section: str):
    """The dataclass of ``section`` (``"cache.host"`` -> ``settings.cache_host``)."""
    return getattr(settings, section.replace(".", "_"))


def default_of(section: str, key: str) -> Any:
    f = next(f for f in fields(SECTIONS[section]) if f.name == key)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
