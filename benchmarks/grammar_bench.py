#!/usr/bin/env python
"""Structured-generation benchmark (CPU): radixd's grammar backend against xgrammar and
llguidance in the same run, on SmolLM2's tokenizer (the cached default model).

1. Compile time (p50, p99) of every JSON Schema of benchmarks/grammar_suite.py (52 schemas), plus
   its regexes and Lark grammars (radixd only: xgrammar reads no Lark, llguidance's Lark
   dialect differs).
2. Time per mask (p50, p99) along valid documents: for each schema, ``--docs`` seeded valid
   documents are tokenized and, at every token, the backend's mask for the next token is
   filled (radixd: ``Matcher.fill_mask`` into a bool row; radixd+close:
   ``fill_mask_within`` as the engine calls it, with the budget the document just fits; xgrammar:
   ``fill_next_token_bitmask``; llguidance: ``fill_next_token_bitmask``), then the token is
   accepted. The first document of a schema meets every state cold; later ones reuse masks.
3. End to end (``--e2e``): an in-process ``Engine`` on the default model, 16 concurrent
   chat requests (one per suite schema, all 52, greedy, ``--max-tokens``; a short prompt
   naming the fields), unconstrained versus constrained by the schema (radixd's backend, and
   xgrammar's through plugins-contrib/radixd-xgrammar): output tokens per second over the
   run, the steady-state decode throughput (decode-only steps with all 16 slots busy, timed
   from one step's completion to the next), and how many constrained outputs parse and
   validate (``jsonschema``); radixd's backend with ``[grammar] close_within_max_tokens`` on
   (the default) and off.

    python -m benchmarks.grammar_bench --e2e                  # everything (several minutes on CPU)
    python -m benchmarks.grammar_bench --docs 1               # masks and compile only, quicker
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from benchmarks import grammar_suite as gs
from benchmarks.common import RESULTS, ROOT, builtin_plugins, environment, write_json

DEFAULT_OUT = RESULTS / "grammar" / "grammar_cpu.json"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summary(xs: list[float], scale: float) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50) * scale, "p90": pct(xs, 90) * scale, "p99": pct(xs, 99) * scale,
            "max": max(xs) * scale if xs else float("nan")}


def documents(n_docs: int) -> dict[str, list[str]]:
    out = {}
    for name, schema in gs.SCHEMAS.items():
        rng = random.Random(hash(name) & 0xFFFF)
        docs = []
        for i in range(n_docs):
            seps = (",", ":") if i % 2 else (", ", ": ")
            docs.append(json.dumps(gs.example(schema, rng), ensure_ascii=False, separators=seps))
        out[name] = docs
    return out


# ---------------------------------------------------------------------------------------------
# Backends behind one small interface: compile(kind, spec) -> factory of per-document runs
# ---------------------------------------------------------------------------------------------


class RadixdRun:
    """radixd's matcher; ``closing``: masks through ``fill_mask_within`` (as the engine fills
    them) with a budget of the document's remaining bytes plus its EOS, the tightest that
    keeps every token of the document allowed (so the filter works near each document's end)."""

    name = "radixd"

    def __init__(self, tok, vocab_size, eos, closing: bool = False):
        from radixd.grammars.backend import RadixdBackend

        self.backend = RadixdBackend(None, tokenizer=tok, vocab_size=vocab_size, eos_ids=(eos,))
        self.vocab = self.backend.vocab
        self.row = np.zeros(vocab_size, dtype=bool)
        self.closing = closing
        if closing:
            self.name = "radixd+close"

    def compile(self, kind, spec):
        return self.backend.compile(kind, spec)

    def walk(self, compiled, ids, times) -> bool:
        m = compiled.matcher()
        row = self.row
        left = sum(len(self.vocab.token_bytes[t]) for t in ids) + 1
        for t in ids:
            t0 = time.perf_counter()
            if self.closing:
                m.fill_mask_within(row, left)
            else:
                m.fill_mask(row)
            times.append(time.perf_counter() - t0)
            if not row[t] or not m.accept_token(t):
                return False
            left -= len(self.vocab.token_bytes[t])
        return True


class XGrammarRun:
    name = "xgrammar"

    def __init__(self, tok, vocab_size, eos):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bits = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind, spec):
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_json_schema(spec, any_whitespace=True, max_whitespace_cnt=2)

    def walk(self, compiled, ids, times) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.bits, 0)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                return False
        return True


class LLGuidanceRun:
    name = "llguidance"

    def __init__(self, tok, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.lln = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size, eos_token=eos)
        self.bits = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind, spec):
        # llguidance compiles when a matcher is made; that is what is timed here
        if kind == "regex":
            g = self.ll.LLMatcher.grammar_from_regex(spec)
        else:
            g = self.ll.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": True})
        m = self.ll.LLMatcher(self.tok, g)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return g

    def walk(self, grammar, ids, times) -> bool:
        m = self.ll.LLMatcher(self.tok, grammar)
        for t in ids:
            t0 = time.perf_counter()
            self.lln.fill_next_token_bitmask(m, self.bits, 0)
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                return False
        return True


def bench_backend(run, tok, docs: dict[str, list[str]]) -> dict:
    compile_s: list[float] = []
    mask_s: list[float] = []
    mask_cold: list[float] = []
    mask_later: list[float] = []
    failures: list[str] = []
    for name, schema in gs.SCHEMAS.items():
        spec = json.dumps(schema)
        t0 = time.perf_counter()
        try:
            compiled = run.compile("json_schema", spec)
        except Exception as exc:  # noqa: BLE001 - a backend refusing a schema is a result
            failures.append(f"{name}: compile: {str(exc)[:120]}")
            continue
        compile_s.append(time.perf_counter() - t0)
        for i, text in enumerate(docs[name]):
            times: list[float] = []
            if not run.walk(compiled, tok(text).input_ids, times):
                failures.append(f"{name}: refused {text[:60]!r}")
            mask_s += times
            if i == 0:
                mask_cold += times
            else:
                mask_later += times
    regex_s = []
    for name, (pattern, valid) in gs.REGEXES.items():
        t0 = time.perf_counter()
        try:
            compiled = run.compile("regex", pattern)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"regex {name}: {exc}")
            continue
        regex_s.append(time.perf_counter() - t0)
        for text in valid:
            times = []
            if not run.walk(compiled, tok(text).input_ids, times):
                failures.append(f"regex {name}: refused {text!r}")
            mask_s += times
    out = {"compile_ms": summary(compile_s, 1e3), "mask_us": summary(mask_s, 1e6),
           "mask_first_document_us": summary(mask_cold, 1e6), "mask_later_documents_us": summary(mask_later, 1e6),
           "regex_compile_ms": summary(regex_s, 1e3),
           "schemas_compiled": len(compile_s), "failures": failures}
    if run.name.startswith("radixd"):
        lark_s = []
        for name, (grammar, valid) in gs.LARK.items():
            t0 = time.perf_counter()
            compiled = run.compile("ebnf", grammar)
            lark_s.append(time.perf_counter() - t0)
            for text in valid:
                if not run.walk(compiled, tok(text).input_ids, []):
                    failures.append(f"lark {name}: refused {text!r}")
        out["lark_compile_ms"] = summary(lark_s, 1e3)
    return out


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def xgrammar_plugin():
    """The contrib xgrammar backend: the installed one (``pip install
    ./plugins-contrib/radixd-xgrammar``), else the package read from its directory here."""
    try:
        import radixd_xgrammar
    except ImportError:
        pkg = ROOT / "plugins-contrib" / "radixd-xgrammar" / "radixd_xgrammar"
        spec = importlib.util.spec_from_file_location("radixd_xgrammar", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
        radixd_xgrammar = importlib.util.module_from_spec(spec)
        sys.modules["radixd_xgrammar"] = radixd_xgrammar
        spec.loader.exec_module(radixd_xgrammar)
    return radixd_xgrammar


async def e2e(backend: str | None, max_tokens: int, concurrency: int, close: bool = True) -> dict:
    import jsonschema

    from radixd import Engine
    from radixd.core.sampling_params import SamplingParams
    pm = builtin_plugins(extra=[xgrammar_plugin()] if backend == "xgrammar" else [])
    engine = Engine(model="default", kv_cache_tokens=60000, max_running_requests=concurrency, plugin_manager=pm,
                    grammar_backend=backend or "radixd", grammar_close_within_max_tokens=close)
    sem = asyncio.Semaphore(concurrency)
    names = list(gs.SCHEMAS)
    try:
        # warm-up: one short request (and compile every schema, timed apart)
        _ = [o async for o in engine.generate("Hi", params=SamplingParams(max_new_tokens=4, temperature=0.0))]
        t0 = time.perf_counter()
        grammars = {}
        if backend is not None:
            for n in names:
                grammars[n] = await engine.compile_grammar(SamplingParams(json_schema=gs.SCHEMAS[n]))
        compile_all_s = time.perf_counter() - t0

        steps: list[tuple[float, int, bool]] = []  # (completion time, picks, had a prefill chunk)

        def hook(step):
            steps.append((time.perf_counter(), len(step.sampled), any(n > 1 for n in step.batch.extend_lens)))

        engine.step_hook = hook
        mask_time = [0.0, 0]  # seconds in Scheduler.fill_masks (the loop thread), calls

        def timed(fill):
            def fill_masks(rows, constrained):
                t = time.perf_counter()
                try:
                    return fill(rows, constrained)
                finally:
                    mask_time[0] += time.perf_counter() - t
                    mask_time[1] += 1
            return fill_masks

        for rep in engine.replicas:
            rep.scheduler.fill_masks = timed(rep.scheduler.fill_masks)

        async def one(name: str):
            schema = gs.SCHEMAS[name]
            fields = ", ".join(schema.get("properties", {})) or "any"
            msg = [{"role": "user", "content": f"Reply with one JSON document (fields: {fields})."}]
            ids = engine.apply_chat_template(msg)
            params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0,
                                    json_schema=schema if backend is not None else None)
            async with sem:
                sub = engine.submit(input_ids=ids, params=params, grammar=grammars.get(name))
                outs = [o async for o in sub]
            return "".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_tokens

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(n) for n in names])
        wall = time.perf_counter() - t0
    finally:
        await engine.stop()
    # steady state: decode-only steps with every slot busy, timed completion to completion
    full = [(t1 - t0_, n) for (t0_, _, _), (t1, n, pre) in zip(steps, steps[1:], strict=False)
            if n == concurrency and not pre]
    steady = sum(n for _, n in full) / sum(dt for dt, _ in full) if full else float("nan")
    tokens = sum(r[2] for r in results)
    valid, finished, bad = 0, 0, []
    for name, (text, reason, _) in zip(names, results, strict=True):
        if backend is None:
            continue
        if reason == "stop":
            finished += 1
        try:
            jsonschema.validate(json.loads(text), gs.SCHEMAS[name])
            valid += 1
        except Exception as exc:  # noqa: BLE001
            bad.append(f"{name} ({reason}): {type(exc).__name__} on {text[:80]!r}")
    name = backend or "unconstrained"
    if backend == "radixd" and not close:
        name = "radixd (close off)"
    budgets = [getattr(g, "budget", None) for g in grammars.values()]
    closing = {"masks_narrowed": sum(b.filtered for b in budgets if b is not None),
               "searches": sum(b.searches for b in budgets if b is not None),
               "searches_capped": sum(b.capped for b in budgets if b is not None)}
    return {"backend": name, "requests": len(names), "concurrency": concurrency, "closing_filter": closing,
            "mask_fill_s": mask_time[0], "mask_fills": mask_time[1],
            "max_tokens": max_tokens, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "steady_decode_tokens_per_s": steady, "steady_steps": len(full),
            "finished_by_grammar_or_eos": finished, "valid": valid, "invalid": bad,
            "outputs": {name: {"text": text, "finish_reason": reason, "tokens": n}
                        for name, (text, reason, n) in zip(names, results, strict=True)},
            "compile_all_schemas_s": compile_all_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=3, help="valid documents per schema for the mask timings")
    ap.add_argument("--backends", default="radixd,radixd+close,xgrammar,llguidance")
    ap.add_argument("--e2e", action="store_true", help="also the end-to-end engine run (default model, CPU)")
    ap.add_argument("--e2e-only", action="store_true", help="only the end-to-end run")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from radixd.core.model_loader import resolve_model

    path = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(str(path))
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    eos = tok.eos_token_id
    docs = documents(args.docs)
    report = {"environment": environment(),
              "tokenizer": "SmolLM2-135M-Instruct", "vocab_size": vocab_size, "schemas": len(gs.SCHEMAS),
              "docs_per_schema": args.docs, "backends": {}}
    runs = {"radixd": RadixdRun, "radixd+close": lambda *a: RadixdRun(*a, closing=True),
            "xgrammar": XGrammarRun, "llguidance": LLGuidanceRun}
    for name in ([] if args.e2e_only else args.backends.split(",")):
        try:
            run = runs[name](tok, vocab_size, eos)
        except ImportError as exc:
            report["backends"][name] = {"skipped": str(exc)}
            continue
        r = bench_backend(run, tok, docs)
        report["backends"][name] = r
        print(f"{name:11s} compile p50 {r['compile_ms']['p50']:7.2f} ms p99 {r['compile_ms']['p99']:8.2f} ms | "
              f"mask p50 {r['mask_us']['p50']:7.2f} us p99 {r['mask_us']['p99']:9.2f} us | "
              f"failures {len(r['failures'])}", flush=True)
    if args.e2e or args.e2e_only:
        report["e2e"] = []
        for backend, close in ((None, True), ("radixd", True), ("radixd", False), ("xgrammar", True)):
            r = asyncio.run(e2e(backend, args.max_tokens, args.concurrency, close))
            report["e2e"].append(r)
            print(f"e2e {r['backend']:13s} {r['tokens_per_s']:7.1f} tok/s ({r['output_tokens']} tokens, "
                  f"{r['wall_s']:.1f} s); steady state at {args.concurrency} running: "
                  f"{r['steady_decode_tokens_per_s']:.1f} tok/s over {r['steady_steps']} steps; "
                  f"valid {r['valid']}/{r['requests']} (finished {r['finished_by_grammar_or_eos']}); "
                  f"{r['mask_fill_s']:.2f} s filling masks ({r['mask_fills']} batches)", flush=True)
    write_json(args.out, report, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
