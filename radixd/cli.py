"""The ``radixd`` command line."""

from __future__ import annotations

import argparse
import sys

from radixd import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixd", description="An LLM serving daemon with radix attention.")
    p.add_argument("--version", action="version", version=f"radixd {__version__}")
    p.add_argument("--config", metavar="FILE", help="serve with this radixd.toml (default: built-in defaults)")
    sub = p.add_subparsers(dest="command")
    chk = sub.add_parser("check-config", help="check a radixd.toml and exit (0: valid, 2: invalid)")
    chk.add_argument("file")
    pull = sub.add_parser("pull", help="fetch and convert a model into the local cache")
    pull.add_argument("model", nargs="?", default="default", help="'default', a .gguf file or a checkpoint directory")
    pull.add_argument("--cache-dir", default=None, help="cache directory (default: $RADIXD_CACHE or ~/.cache/radixd)")
    sub.add_parser("plugins", help="list the plugins that load, and where from")
    gen = sub.add_parser("generate", help="generate a reply in-process (no server) and stream it")
    gen.add_argument("prompt", help="the user message (chat template applied) or raw text with --raw")
    gen.add_argument("--model", default="default")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    from radixd.bench import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="the serving benchmark: a server over HTTP, the engine or the hf peer")
    add_bench_arguments(bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        from radixd.core.errors import ConfigError
        from radixd.server.daemon import serve_forever

        try:
            return serve_forever(args.config)
        except ConfigError as exc:
            print(f"radixd: {exc}", file=sys.stderr)
            return 2
    if args.command == "check-config":
        from radixd.core.errors import ConfigError
        from radixd.settings import load_settings

        try:
            settings = load_settings(args.file)
            settings.api_keys()
        except ConfigError as exc:
            print(f"radixd: {exc}", file=sys.stderr)
            return 2
        print(f"{args.file}: ok")
        return 0
    if args.command == "pull":
        from radixd.core.model_loader import resolve_model

        path = resolve_model(args.model, args.cache_dir)
        print(path)
        return 0
    if args.command == "plugins":
        from radixd.plugins import make_plugin_manager
        from radixd.settings import load_settings

        settings = load_settings(args.config)
        pm = make_plugin_manager(load_entry_points=settings.plugins.entry_points,
                                 allow=settings.plugins.allow or None, block=settings.plugins.block)
        for name, plugin in pm.list_name_plugin():
            if plugin is None:  # blocked by the allow/block lists
                continue
            where = getattr(plugin, "__file__", None) or type(plugin).__module__
            print(f"{name}\t{where}")
        return 0
    if args.command == "generate":
        import asyncio

        return asyncio.run(_generate(args))
    if args.command == "bench":
        from radixd.bench import main as bench_main

        return bench_main(args, _bench_argv(argv))
    return 2


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
