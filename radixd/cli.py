"""The ``radixd`` command line."""

from __future__ import annotations

import argparse
import sys

from radixd import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixd", description="An LLM serving daemon with radix attention.")
    p.add_argument("--version", action="version", version=f"radixd {__version__}")
    sub = p.add_subparsers(dest="command")
    pull = sub.add_parser("pull", help="fetch and convert a model into the local cache")
    pull.add_argument("model", nargs="?", default="default", help="'default', a .gguf file or a checkpoint directory")
    pull.add_argument("--cache-dir", default=None, help="cache directory (default: $RADIXD_CACHE or ~/.cache/radixd)")
    sub.add_parser("plugins", help="list the plugins that load, and where from")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "pull":
        from radixd.core.model_loader import resolve_model

        path = resolve_model(args.model, args.cache_dir)
        print(path)
        return 0
    if args.command == "plugins":
        from radixd.plugins import make_plugin_manager

        pm = make_plugin_manager()
        for name, plugin in pm.list_name_plugin():
            where = getattr(plugin, "__file__", None) or type(plugin).__module__
            print(f"{name}\t{where}")
        return 0
    build_parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
