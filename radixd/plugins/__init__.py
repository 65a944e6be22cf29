"""radixd's plugin system: one project name, one pair of markers, one entry-point group.

Built-in features (the ``fcfs`` and ``lpm`` policies, the ``host`` and ``disk`` cache tiers, the ``radixd``
grammar backend, the reasoning and tool-call parsers, the ``ngram`` drafter) are plugins registered exactly like
third-party ones; third-party packages register through the ``radixd`` entry-point group.
Factory hooks hand back plain objects that the engine then calls directly, so no pluggy
call sits on a per-token path; ``wiring`` makes them into the parts of ``radixd.Engine``.
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from radixd.plugins.markers import PROJECT, hookimpl, hookspec

__all__ = ["DEFAULT_PLUGINS", "PROJECT", "describe_plugins", "hookimpl", "hookspec", "make_plugin_manager"]

# What a plugin can provide: the factory hook, and how ``radixd plugins`` names it.
PROVIDES = (("radixd_schedule_policies", "policies"), ("radixd_cache_tiers", "tiers"),
            ("radixd_grammar_backends", "grammar backends"), ("radixd_reasoning_parsers", "reasoning parsers"),
            ("radixd_tool_parsers", "tool parsers"), ("radixd_kv_transfer_backends", "KV transfer backends"),
            ("radixd_drafters", "drafters"))

# Modules registered on every plugin manager before entry points are loaded.
DEFAULT_PLUGINS = ("radixd.plugins.policies", "radixd.plugins.tiers", "radixd.grammars.backend",
                   "radixd.plugins.reasoning", "radixd.server.tool_parsers", "radixd.plugins.mooncake",
                   "radixd.plugins.drafters")


def make_plugin_manager(
    *,
    load_entry_points: bool = True,
    allow: Iterable[str] | None = None,
    block: Iterable[str] = (),
    extra: Iterable[object] = (),
) -> pluggy.PluginManager:
    """Build a plugin manager with the built-in plugins, entry-point plugins and ``extra``.

    ``allow`` (if given) and ``block`` filter entry-point plugins by their entry-point name;
    built-ins and ``extra`` objects are always registered.
    """
    import importlib

    from radixd.plugins import hookspecs

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        allowed = set(allow) if allow is not None else None
        for name in block:
            pm.set_blocked(name)
        if allowed is None:
            pm.load_setuptools_entrypoints(PROJECT)
        else:
            for ep_name in _entry_point_names():
                if ep_name not in allowed:
                    pm.set_blocked(ep_name)
            pm.load_setuptools_entrypoints(PROJECT)
    for obj in extra:
        pm.register(obj)
    pm.check_pending()  # a misspelled radixd_* hook is an error, not a silent no-op
    return pm


def describe_plugins(pm: pluggy.PluginManager) -> list[tuple[str, str, dict[str, list[str]]]]:
    """(name, where it is from, what it provides) of each registered plugin: the names its
    factory hooks return, its routes (``radixd_routes`` is asked without a server, so a
    plugin whose routes need one is listed as providing routes, unnamed) and its other hooks."""
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked by the allow/block lists
            continue
        provides: dict[str, list[str]] = {}
        impls = {impl.function.__name__: impl.function for hook in pm.get_hookcallers(plugin) or []
                 for impl in hook.get_hookimpls() if impl.plugin is plugin}
        for hook_name, what in PROVIDES:
            if hook_name in impls:
                provides[what] = sorted(impls[hook_name]() or {})
        if "radixd_routes" in impls:
            try:
                routes = impls["radixd_routes"](state=None) or []
                provides["routes"] = [f"{' '.join(sorted(getattr(r, 'methods', None) or []))} {r.path}".strip()
                                      for r in routes]
            except Exception:  # the routes are made from a running server's state
                provides["routes"] = ["(made at start-up)"]
        hooks = sorted(set(impls) - {h for h, _ in PROVIDES} - {"radixd_routes"})
        if hooks:
            provides["hooks"] = hooks
        where = getattr(plugin, "__file__", None) or type(plugin).__module__
        out.append((name, where, provides))
    return out


def _entry_point_names() -> list[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group=PROJECT)]
