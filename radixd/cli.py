"""The ``radixd`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from radixd import __version__, launch_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixd", description="An LLM serving daemon with radix attention.")
    p.add_argument("--version", action="version", version=f"radixd {__version__}")
    p.add_argument("--config", metavar="FILE", help="serve with this radixd.toml (default: built-in defaults)")
    launch_flags.add_to(p)
    sub = p.add_subparsers(dest="command")
    chk = sub.add_parser("check-config", help="check a radixd.toml (and launch flags), print the merged "
                                              "settings and exit (0: valid, 2: invalid)")
    chk.add_argument("file", nargs="?", default=None)
    launch_flags.add_to(chk, subcommand=True)
    pull = sub.add_parser("pull", help="fetch and convert a model into the local cache")
    pull.add_argument("model", nargs="?", default="default", help="'default', a .gguf file or a checkpoint directory")
    pull.add_argument("--cache-dir", default=None, help="cache directory (default: $RADIXD_CACHE or ~/.cache/radixd)")
    plugins = sub.add_parser("plugins", help="list the plugins that load, where from (and what each provides)")
    plugins.add_argument("--provides", action="store_true",
                         help="under each plugin, its policies, tiers, grammar backends, routes and hooks")
    gen = sub.add_parser("generate", help="generate a reply in-process (no server) and stream it")
    gen.add_argument("prompt", help="the user message (chat template applied) or raw text with --raw")
    gen.add_argument("--model", default="default")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    from radixd.bench import add_arguments as add_bench_arguments

    top = sub.add_parser("top", help="a running daemon's dashboard feed in the terminal ([server] dashboard = true)")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the daemon (default: %(default)s)")
    top.add_argument("--api-key", default=os.environ.get("RADIXD_API_KEY"), help="an API key (default: $RADIXD_API_KEY)")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    bench = sub.add_parser("bench", help="the serving benchmark: a server over HTTP, the engine or the hf peer")
    add_bench_arguments(bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in (None, "check-config"):
        given = [f.name for f in launch_flags.FLAGS if getattr(args, f.dest, None) is not None]
        if given:  # they would be silently ignored
            parser.error(f"{', '.join(given)}: launch flags apply to the daemon and check-config, not to "
                         f"'{args.command}'")
    if args.command is None:
        from radixd.core.errors import ConfigError
        from radixd.server.daemon import serve_forever

        try:
            return serve_forever(args.config, launch_flags.overrides(args))
        except ConfigError as exc:
            print(f"radixd: {exc}", file=sys.stderr)
            return 2
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "pull":
        from radixd.core.model_loader import resolve_model

        path = resolve_model(args.model, args.cache_dir)
        print(path)
        return 0
    if args.command == "plugins":
        from radixd.plugins import describe_plugins
        from radixd.settings import load_settings

        pm = _plugin_manager(load_settings(args.config))
        for name, where, provides in describe_plugins(pm):
            print(f"{name}\t{where}")
            for what, names in provides.items() if args.provides else ():
                print(f"  {what}: {', '.join(names)}")
        return 0
    if args.command == "generate":
        import asyncio

        return asyncio.run(_generate(args))
    if args.command == "top":
        from radixd.top import main as top_main

        return top_main(args.url, args.api_key, args.once)
    if args.command == "bench":
        from radixd.bench import main as bench_main

        return bench_main(args, _bench_argv(argv))
    return 2


def _check_config(args) -> int:
    """Every error of the file and flags, one a line; else the merged settings as TOML."""
    from radixd.core.errors import ConfigError
    from radixd.settings import ConfigErrors, load_settings, render_settings

    file = args.file or args.config  # ``radixd --config FILE check-config`` checks FILE
    where = file or "(built-in defaults)"
    try:
        flags = launch_flags.overrides(args)
        settings = load_settings(file, flags)
        settings.api_keys()
        _check_plugin_names(settings, flags)
    except ConfigErrors as exc:
        for e in exc.errors:
            print(f"radixd: {where}: {e}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"radixd: {where}: {exc}", file=sys.stderr)
        return 2
    print(f"# {where}: ok" + (f"; flags: {' '.join(launch_flags.flag_of(k) or k for k in flags)}" if flags else ""))
    print(render_settings(settings, {k: launch_flags.flag_of(k) for k in flags}))
    return 0


def _check_plugin_names(settings, flags: dict) -> None:
    """Keys that name what plugins provide, checked against the plugins that load (an error
    names the launch flag that set the key, if one did)."""
    from radixd.core.errors import ConfigError
    from radixd.plugins.wiring import provided_names
    from radixd.server import reasoning
    from radixd.server.tool_calls import check_parser_setting, parser_table

    pm = _plugin_manager(settings)
    try:
        reasoning.check_setting(settings.model.reasoning_parser, reasoning.available(pm))
        check_parser_setting(settings.model.tool_parser, parser_table(pm))
        provided_names(settings.engine_config(), pm.hook)
    except ConfigError as exc:
        flag = launch_flags.flag_of(exc.key) if exc.key in flags else None
        raise ConfigError(f"{flag} ({exc.key})", exc.value, exc.allowed) if flag else exc from exc


def _plugin_manager(settings):
    """The plugins ``settings`` ask for, as the daemon loads them."""
    from radixd.plugins import make_plugin_manager

    return make_plugin_manager(load_entry_points=settings.plugins.entry_points,
                               allow=settings.plugins.allow or None, block=settings.plugins.block)


def _bench_argv(argv: list[str] | None) -> list[str]:
    """The words after ``bench`` (recorded in the JSON report)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return words[words.index("bench") + 1:] if "bench" in words else words


async def _generate(args) -> int:
    from radixd import Engine
    from radixd.core.errors import InvalidRequest
    from radixd.core.sampling_params import SamplingParams

    engine = Engine(model=args.model)
    try:
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.raw:
            stream = engine.generate(args.prompt, params=params)
        else:
            ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
            stream = engine.generate(input_ids=ids, params=params)
        async for out in stream:
            print(out.text, end="", flush=True)
        print()
        return 0
    except InvalidRequest as exc:
        print(f"radixd: {exc}", file=sys.stderr)
        return 2
    finally:
        await engine.stop()


if __name__ == "__main__":
    sys.exit(main())
