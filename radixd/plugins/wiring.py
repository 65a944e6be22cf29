"""Plugins wired into an engine: ``radixd.Engine`` is the core engine built from the parts
that the factory hooks provide.

    make_plugin_manager -> ModelSetup.load (no weights yet)
      radixd_schedule_policies -> the policy class (each replica makes its own)
      radixd_cache_tiers       -> the tier objects named in cache_tiers
      radixd_grammar_backends  -> the backend behind a GrammarService
      radixd_drafters          -> the drafter class named by speculative_algorithm
    -> radixd.core.engine.Engine(config, policy=..., tiers=..., grammars=..., setup=...)

Names are checked, and tiers and the grammar service made, before any weights load: a
misspelt name fails at once. This module is the only place where core meets plugins and
grammars: ``radixd.core`` imports neither.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace

import pluggy

from radixd.core import engine as core
from radixd.core.assembly import ModelSetup, tier_context
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError, InvalidRequest
from radixd.core.tiers import CacheTier
from radixd.grammars import GrammarError
from radixd.grammars.backend import RadixdBackend
from radixd.grammars.service import GrammarService, backend_in_worker
from radixd.grammars.vocab import TokenizerInfo
from radixd.plugins import make_plugin_manager

log = logging.getLogger("radixd.engine")


class Engine(core.Engine):
    """``radixd.Engine``: ``Engine(model=..., **overrides)`` or ``Engine(config,
    plugin_manager=pm)`` (default: the built-ins plus the allowed entry-point plugins)."""

    def __init__(self, config: EngineConfig | None = None, *, plugin_manager: pluggy.PluginManager | None = None,
                 **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        if plugin_manager is None:
            plugin_manager = make_plugin_manager(allow=config.plugins_allow, block=config.plugins_block)
        self.plugins = plugin_manager
        hook = plugin_manager.hook
        policies, backends, drafters, tier_table = provided_names(config, hook)
        setup = ModelSetup.load(config)
        algorithm = config.speculative_algorithm
        tiers = make_tiers(config, setup, tier_table)
        grammars = None
        try:
            if setup.tokenizer is not None:  # without one, constrained requests are refused
                grammars = make_grammar_service(config, setup, backends[config.grammar_backend])
            super().__init__(config, policy=policies[config.policy], tiers=tiers, grammars=grammars, setup=setup,
                             drafter=drafters[algorithm] if algorithm else None)
        except BaseException:
            for t in tiers:
                t.close()
            if grammars is not None:
                grammars.shutdown()
            raise


def provided_names(config: EngineConfig, hook) -> tuple[dict[str, type], ...]:
    """The plugins' tables of scheduling policies, grammar backends, drafters and cache tiers,
    once each name ``config`` gives is checked against its table (a ``ConfigError`` naming
    the key and what the loaded plugins provide)."""
    policies = provided(hook.radixd_schedule_policies, "scheduling policy")
    if config.policy not in policies:
        raise ConfigError("policy", config.policy, "one of " + ", ".join(sorted(policies)))
    backends = provided(hook.radixd_grammar_backends, "grammar backend")
    if config.grammar_backend not in backends:
        raise ConfigError("grammar_backend", config.grammar_backend, "one of " + ", ".join(sorted(backends)))
    drafters = provided(hook.radixd_drafters, "drafter")
    algorithm = config.speculative_algorithm
    if algorithm and algorithm not in drafters:
        raise ConfigError("speculative_algorithm", algorithm, '"" (off) or one of ' + ", ".join(sorted(drafters)))
    tiers = provided(hook.radixd_cache_tiers, "cache tier")
    for name in config.cache_tiers:
        if name not in tiers:
            raise ConfigError("cache.tiers", name, "tiers provided by loaded plugins: " + ", ".join(sorted(tiers)))
    return policies, backends, drafters, tiers


def provided(hook: Callable[[], list], what: str) -> dict[str, type]:
    """The ``{name: class}`` tables of a factory hook's implementations, joined; two plugins
    giving one name to different classes is an error."""
    table: dict[str, type] = {}
    for part in hook():
        for key, cls in (part or {}).items():
            if key in table and table[key] is not cls:
                raise ValueError(f"two plugins provide a {what} named {key!r}")
            table[key] = cls
    return table


def make_tiers(config: EngineConfig, setup: ModelSetup, table: dict[str, type]) -> list[CacheTier]:
    """The tiers named in ``cache_tiers``, fastest first, each with its ``[cache.NAME]``
    options (none closed here on success: the engine closes them)."""
    c = config
    if not c.cache_tiers:
        return []
    ctx = tier_context(config, setup)
    tiers = []
    try:
        for name in c.cache_tiers:  # (names checked by ``provided_names``)
            tier = table[name](dict(c.cache_tier_options.get(name, {})), ctx)
            tier.name = name
            tiers.append(tier)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    log.info("cache tiers: %s (pages of %d tokens, %d bytes; %s)", ", ".join(c.cache_tiers), c.cache_page_tokens,
             ctx.page_bytes, c.cache_write_policy)
    return tiers


class EngineGrammars(GrammarService):
    """A ``GrammarService`` as the core engine's ``GrammarCompiler``: a constraint that does
    not compile raises ``InvalidRequest`` naming its field (HTTP 400)."""

    async def get(self, kind: str, spec: str, after: str | None = None):
        try:
            return await super().get(kind, spec, after)
        except GrammarError as exc:
            raise InvalidRequest(exc.field, exc.message) from None


def make_grammar_service(config: EngineConfig, setup: ModelSetup, backend_cls: type) -> EngineGrammars:
    """``backend_cls`` for the engine's tokenizer behind a compile service (with
    ``grammar_compile_memory_mb``: new grammars first compile in a limited worker process)."""
    from radixd.core.sandbox import LimitedPool

    c = config
    args = (setup.tokenizer, setup.cfg.vocab_size, setup.eos_token_ids)
    backend = backend_cls(c, tokenizer=args[0], vocab_size=args[1], eos_ids=args[2])
    limits = None
    if c.grammar_compile_memory_mb:
        limits = LimitedPool(c.grammar_compile_workers, timeout_s=c.grammar_compile_timeout,
                             memory_bytes=c.grammar_compile_memory_mb * 2**20, initializer=backend_in_worker,
                             initargs=(backend_cls, c, *args))
    return EngineGrammars(backend, workers=c.grammar_compile_workers, timeout_s=c.grammar_compile_timeout,
                          cache_size=c.grammar_cache_size, limits=limits, vocab=vocab_of(backend, *args))


def vocab_of(backend, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> Callable[[], TokenizerInfo]:
    """The vocabulary ``grammar_after`` scans: the radixd backend's own, else one made on first use."""
    if isinstance(backend, RadixdBackend):
        return lambda: backend.vocab
    return functools.cache(lambda: TokenizerInfo.from_tokenizer(tokenizer, vocab_size, eos_ids))
