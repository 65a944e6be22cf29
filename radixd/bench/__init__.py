"""``radixd bench``: the serving benchmark.

Targets: a server over HTTP (radixd's native ``/generate`` or any OpenAI-compatible
``/v1/completions`` / ``/v1/chat/completions``, streamed, latencies measured by the client),
the in-process ``radixd.Engine``, and transformers' ``generate()`` on the same model (the naive
peer). Workloads are generated locally from ``--seed``. See ``man radixd`` (BENCH).

Modules: ``workloads`` (prompts), ``targets`` (sending them), ``runner`` (arrivals,
concurrency, the greedy check), ``metrics`` (figures), ``report`` (table, JSON, compare),
``plots`` (PNG). This module only builds the command line, cheaply; the rest is imported
when the command runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from radixd.bench.workloads import WORKLOADS


def _range(text: str) -> tuple[int, int]:
    from radixd.bench.workloads import parse_range

    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests per second, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be above 0, got {text!r}")
    return v


def _list(text: str) -> list[int]:
    try:
        values = [_positive(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixd bench`` (and its ``compare`` subcommand)."""
    t = p.add_argument_group("target")
    t.add_argument("--target", choices=("http", "engine", "hf"), default="http",
                   help="a server over HTTP, the in-process engine, or transformers generate() (default: http)")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server (http; default: %(default)s)")
    t.add_argument("--api", choices=("native", "completions", "chat"), default="native",
                   help="the route (http): /generate, /v1/completions or /v1/chat/completions (default: native)")
    t.add_argument("--model", default=None,
                   help="engine/hf: 'default', a checkpoint dir or .gguf (default: default); "
                        "http: the model name sent (default: the server's, from /v1/models)")
    t.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer that builds the prompts (default: the model's; http: the default model's)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (http)")
    t.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout, http (default: 600)")
    t.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for the engine target, e.g. kv_cache_tokens=32768 (repeatable)")
    t.add_argument("--hf-batch-size", type=_positive, default=8, metavar="N",
                   help="requests per generate() call of the hf peer (default: 8)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random", help="default: random")
    w.add_argument("--seed", type=int, default=1, help="seed of prompts, lengths and arrivals (default: 1)")
    w.add_argument("--num-prompts", type=_positive, default=64, metavar="N", help="random: prompts (default: 64)")
    w.add_argument("--input-len", type=_range, default=(1024, 1024), metavar="N|MIN:MAX",
                   help="random: prompt tokens (default: 1024)")
    w.add_argument("--output-len", type=_range, default=None, metavar="N|MIN:MAX",
                   help="tokens to generate per request (default: random 128, shared-prefix 256, multi-turn 128)")
    w.add_argument("--groups", type=_positive, default=64, metavar="G", help="shared-prefix: groups (default: 64)")
    w.add_argument("--prompts-per-group", type=_positive, default=16, metavar="P",
                   help="shared-prefix: prompts per group (default: 16)")
    w.add_argument("--system-len", type=_positive, default=2048, metavar="N",
                   help="shared-prefix: tokens of each group's system prompt (default: 2048)")
    w.add_argument("--question-len", type=_positive, default=128, metavar="N",
                   help="shared-prefix: tokens of each question (default: 128)")
    w.add_argument("--conversations", type=_positive, default=16, metavar="N",
                   help="multi-turn: conversations (default: 16)")
    w.add_argument("--turns", type=_positive, default=4, metavar="N", help="multi-turn: turns each (default: 4)")
    w.add_argument("--turn-len", type=_range, default=(128, 128), metavar="N|MIN:MAX",
                   help="multi-turn: tokens of each user turn (default: 128)")
    w.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: generate exactly the output length)")
    w.add_argument("--min-tokens", action="store_true",
                   help="http, OpenAI routes: with ignore_eos also send min_tokens = the output length, "
                        "for servers that ignore ignore_eos (llama.cpp's)")
    a = p.add_argument_group("arrival")
    a.add_argument("--request-rate", type=_rate, default=math.inf, metavar="R",
                   help="Poisson arrivals at R requests/s, seeded (default: all at once)")
    a.add_argument("--max-concurrency", type=_positive, default=None, metavar="C",
                   help="at most C requests in flight (default: no bound)")
    a.add_argument("--sweep-concurrency", type=_list, default=None, metavar="C1,C2,...",
                   help="run the workload once per max concurrency and plot against it")
    a.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed short requests first (default: 1)")
    a.add_argument("--no-flush-cache", action="store_true",
                   help="keep the target's prefix cache from before (default: flush it before each run)")
    o = p.add_argument_group("output")
    o.add_argument("--name", default=None, help="label of the run, in the table and plot file names "
                                                "(default: TARGET-WORKLOAD)")
    o.add_argument("--output", default=None, metavar="FILE", help="write the JSON report here")
    o.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--check-greedy", type=_positive, default=None, metavar="N",
                   help="instead: N prompts through the engine and the hf peer, greedily; "
                        "are the output ids identical? (exit 1 if not)")
    sub = p.add_subparsers(dest="bench_command", metavar="compare")
    cmp_ = sub.add_parser("compare", help="the main figures of two JSON reports side by side, with ratios")
    cmp_.add_argument("first", metavar="A.json")
    cmp_.add_argument("second", metavar="B.json")


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run ``radixd bench``; the exit status (0 done, 1 target unusable or greedy outputs
    differ, 2 bad arguments or an unsupported workload)."""
    if getattr(args, "bench_command", None) == "compare":
        from radixd.bench.report import compare

        try:
            print(compare(args.first, args.second))
        except (OSError, ValueError) as exc:
            print(f"radixd bench compare: {exc}", file=sys.stderr)
            return 2
        return 0
    import asyncio

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from radixd.bench.targets import TargetError
    from radixd.bench.workloads import UsageError

    argv = list(sys.argv[2:] if argv is None else argv)
    try:
        return asyncio.run(_main(args, argv))
    except UsageError as exc:
        print(f"radixd bench: {exc}", file=sys.stderr)
        return 2
    except TargetError as exc:
        print(f"radixd bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("radixd bench: interrupted", file=sys.stderr)
        return 130


def _config(args: argparse.Namespace) -> dict:
    out = {}
    for k, v in sorted(vars(args).items()):
        if k in ("command", "config", "bench_command", "api_key"):
            continue
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, float) and not math.isfinite(v):
            v = None if k != "request_rate" else "inf"
        out[k] = v
    out["api_key"] = "(set)" if args.api_key else None
    return out


def _tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    from radixd.core.model_loader import resolve_model

    source = args.tokenizer
    if source is None:
        source = (args.model or "default") if args.target in ("engine", "hf") or args.check_greedy else "default"
    path = resolve_model(source) if source == "default" or not os.path.isdir(source) else source
    return AutoTokenizer.from_pretrained(str(path))


def _workload(args: argparse.Namespace, tokenizer):
    from radixd.bench.workloads import build

    return build(args.workload, tokenizer, seed=args.seed, num_prompts=args.num_prompts, input_len=args.input_len,
                 output_len=args.output_len, groups=args.groups, prompts_per_group=args.prompts_per_group,
                 system_len=args.system_len, question_len=args.question_len, conversations=args.conversations,
                 turns=args.turns, turn_len=args.turn_len)


def engine_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` words -> EngineConfig overrides, typed after the field's default."""
    from dataclasses import fields

    from radixd.bench.workloads import UsageError
    from radixd.core.config import EngineConfig

    known = {f.name: f for f in fields(EngineConfig)}
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known or key == "model":
            raise UsageError(f"--engine-arg {item!r}: expected KEY=VALUE with KEY one of "
                             + ", ".join(sorted(k for k in known if k != "model")))
        f = known[key]
        kind = str(f.type)
        try:
            if "bool" in kind:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1", "yes")
            elif "int" in kind:
                value = int(text)
            elif "float" in kind:
                value = float(text)
            elif "tuple" in kind:
                value = tuple(x for x in text.split(",") if x)
            elif "dict" in kind:  # e.g. cache_tier_options={"host": {"max_bytes": 1073741824}}
                import json

                value = json.loads(text)
                if not isinstance(value, dict):
                    raise ValueError(text)
            else:
                value = text
        except ValueError:
            raise UsageError(f"--engine-arg {item!r}: {text!r} is not a valid {kind}") from None
        out[key] = value
    return out


def _target(args: argparse.Namespace):
    from radixd.bench.targets import EngineTarget, HFTarget, HttpTarget

    if args.target == "http":
        return HttpTarget(args.url, args.api, model=args.model, api_key=args.api_key, timeout=args.timeout,
                          max_connections=args.max_concurrency, min_tokens=args.min_tokens)
    if args.target == "engine":
        return EngineTarget(args.model or "default", **engine_overrides(args.engine_arg))
    return HFTarget(args.model or "default", batch_size=args.hf_batch_size)


async def _main(args: argparse.Namespace, argv: list[str]) -> int:
    from radixd.bench import report
    from radixd.bench.metrics import figures
    from radixd.bench.runner import check_greedy, quiet_collector, run_once, warmup
    from radixd.bench.workloads import UnsupportedWorkload, UsageError, warmup_spec

    if args.workload == "json":  # before loading anything
        raise UnsupportedWorkload(
            "the json workload is not in radixd bench yet; grammar-constrained throughput is measured by "
            "benchmarks/grammar_bench.py")
    if args.plot_dir:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot-dir needs matplotlib: pip install 'radixd[bench]'") from None
    progress = not args.no_progress
    ignore_eos = not args.disable_ignore_eos

    if args.check_greedy:
        model = args.model or "default"
        workload = _workload(args, _tokenizer(args))
        res = await check_greedy(model, workload, args.check_greedy, hf_batch_size=args.hf_batch_size,
                                 ignore_eos=ignore_eos, progress=progress)
        verdict = "identical" if res["all_identical"] else "NOT identical"
        print(f"greedy check ({model}, {args.workload}): engine and hf output token ids are {verdict} "
              f"for {res['identical']}/{res['prompts']} prompts")
        for p in res["per_prompt"]:
            if not p["identical"]:
                where = f"first difference at token {p['first_difference']}" if "first_difference" in p \
                    else p.get("error")
                print(f"  prompt {p['prompt']} ({p['prompt_tokens']} tokens): {where}")
        if args.output:
            report.write_json(args.output, report.document(
                argv=argv, config=_config(args), target={"kind": "engine vs hf", "model": model},
                workload=workload.describe(), runs=[], extra={"check_greedy": res}))
        return 0 if res["all_identical"] else 1

    target = _target(args)
    try:
        info = await target.start()  # TargetError: unreachable / unloadable -> exit 1
    except (TypeError, ValueError) as exc:  # EngineConfig refused an override (ConfigError)
        raise UsageError(f"--engine-arg: {exc}") from None  # TargetError: unreachable / unloadable -> exit 1
    info["kind"] = args.target
    try:
        tokenizer = _tokenizer(args)
        workload = _workload(args, tokenizer)
        name = args.name or f"{args.target}-{args.workload}"
        if args.warmup > 0:
            err = await warmup(target, warmup_spec(tokenizer, args.seed), args.warmup, ignore_eos)
            if err:
                print(f"radixd bench: the warm-up request failed: {err}", file=sys.stderr)
        levels = args.sweep_concurrency or [args.max_concurrency]
        runs = []
        for level in levels:
            flushed = False if args.no_flush_cache else await target.flush_cache()
            before = await target.cache_counters()
            desc = name if len(levels) == 1 else f"{name} c={level}"
            load0, cpu0 = os.getloadavg()[0], time.process_time()
            with quiet_collector() as pauses:
                records, duration = await run_once(target, workload, request_rate=args.request_rate,
                                                   max_concurrency=level, seed=args.seed, ignore_eos=ignore_eos,
                                                   progress=progress, desc=desc)
            after = await target.cache_counters() if before is not None else None
            figs = figures(records, duration, before, after)
            figs["client_gc"] = pauses.as_dict()  # this process's collections during the run
            runs.append({"max_concurrency": level, "request_rate": None if math.isinf(args.request_rate)
                         else args.request_rate, "cache_flushed": flushed,
                         # the machine may be shared: a load above its cores means waiting for CPU
                         "loadavg_1m_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
                         "bench_process_cpu_s": round(time.process_time() - cpu0, 3),
                         "figures": figs, "records": [r.to_json() for r in records]})
            print(report.table(name if len(levels) == 1 else f"{name}, max concurrency {level}", figs, info))
    finally:
        await target.close()
    if len(runs) > 1:
        print(report.sweep_table(runs))
    doc = report.document(argv=argv, config=_config(args), target=info, workload=workload.describe(), runs=runs)
    doc["name"] = name
    if args.output:
        report.write_json(args.output, doc)
        print(f"radixd bench: wrote {args.output}", file=sys.stderr)
    if args.plot_dir:
        from radixd.bench.plots import plot_all

        for path in plot_all(args.plot_dir, name, runs):
            print(f"radixd bench: wrote {path}", file=sys.stderr)
    return 0

