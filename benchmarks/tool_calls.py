"""Tool calling: valid calls under ``tool_choice`` required and auto, with and without the
tool grammar, and the latency a tool call adds over plain generation of the same length.

The 32 functions of ``benchmarks.tool_suite`` (one tool per request, with its request as the
user turn), the default model on CPU, through the chat route in-process (the app over
``httpx.ASGITransport``: the same parsing, templates and grammars as the daemon).

* required: ``tool_choice: "required"``, greedy and sampled (T = 1, seeded): calls that parse
  and validate against the function's schema, per request.
* auto: one worked example (a weather call, its result and answer) before the request, so
  the model calls tools at all; ``model.tool_grammar`` on and off: how often it calls, and
  how many of its calls parse and validate (and how many of the invalid ones were cut off
  by ``max_tokens``, which no grammar prevents under auto: free text may run to the limit,
  and how many answers hold call markup the parser could not read, returned as text).
* latency: per function, a required call vs a plain answer to the same prompt (no tools,
  ``ignore_eos``) of the same number of tokens, one request at a time, grammars warm;
  the median ratio and the per-token difference.

    python -m benchmarks.tool_calls --out benchmarks/results/tool_calls/tool_calls.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import jsonschema

from benchmarks import tool_suite
from benchmarks.common import RESULTS, environment, write_json

SHOT = [{"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is sunny in Paris, 24 C."}]


def valid(call: dict, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


async def chat(c: httpx.AsyncClient, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = await c.post("/v1/chat/completions", json={"model": "m", **body})
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def score(doc: dict) -> tuple[int, int, int, int]:
    """(calls, valid calls, invalid calls cut off by max_tokens, attempts that came back as
    text: call markup the parser could not read) of a response."""
    choice = doc["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    schemas = {n: f[1] for n, f in tool_suite.FUNCTIONS.items()}
    ok = [c["function"]["name"] in schemas and valid(c, schemas[c["function"]["name"]]) for c in calls]
    cut = choice["finish_reason"] == "length" and bool(ok) and not ok[-1]
    return len(calls), sum(ok), int(cut), int("<tool_call>" in (choice["message"]["content"] or ""))


async def validity(c: httpx.AsyncClient, *, choice: str, temperature: float, shot: bool, max_tokens: int) -> dict:
    async def one(name: str):
        messages = (SHOT if shot else []) + [{"role": "user", "content": tool_suite.request(name)}]
        doc, _ = await chat(c, {"messages": messages, "tools": [tool_suite.tool(name)], "tool_choice": choice,
                                "temperature": temperature, "seed": 7, "max_tokens": max_tokens})
        return score(doc)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(n) for n in tool_suite.FUNCTIONS))
    calls, ok, cut, as_text = (sum(g[k] for g in got) for k in range(4))
    return {"tool_choice": choice, "temperature": temperature, "requests": len(got),
            "requests_with_calls": sum(g[0] > 0 for g in got), "calls": calls, "valid_calls": ok,
            "valid_rate": round(ok / calls, 4) if calls else None, "invalid_cut_by_max_tokens": cut,
            "malformed_as_text": as_text,
            "requests_all_valid": sum(g[0] > 0 and g[0] == g[1] for g in got), "seconds": round(time.perf_counter() - t0, 1)}


async def latency(c: httpx.AsyncClient, names: list[str]) -> dict:
    rows = []
    for name in names:
        messages = [{"role": "user", "content": tool_suite.request(name)}]
        body = {"messages": messages, "tools": [tool_suite.tool(name)], "tool_choice": "required", "temperature": 0,
                "max_tokens": 96}
        await chat(c, body)  # the grammar compiled, the prompt cached
        doc, tool_s = await chat(c, body)
        n = doc["usage"]["completion_tokens"]
        await chat(c, {**body, "tool_choice": "none", "max_tokens": n, "ignore_eos": True})
        plain, plain_s = await chat(c, {**body, "tool_choice": "none", "max_tokens": n, "ignore_eos": True})
        assert plain["usage"]["completion_tokens"] == n
        rows.append({"function": name, "tokens": n, "tool_call_s": round(tool_s, 3), "plain_s": round(plain_s, 3)})
    ratios = [r["tool_call_s"] / r["plain_s"] for r in rows]
    per_token = [(r["tool_call_s"] - r["plain_s"]) / r["tokens"] * 1000 for r in rows]
    return {"runs": rows, "median_ratio": round(statistics.median(ratios), 3),
            "median_extra_ms_per_token": round(statistics.median(per_token), 2)}


async def run(args) -> dict:
    from radixd import Engine
    from radixd.plugins import make_plugin_manager
    from radixd.server.app import ServerState, build_app
    from radixd.settings import settings_from_dict

    pm = make_plugin_manager(load_entry_points=False)
    engine = Engine(model=args.model, kv_cache_tokens=32768, max_running_requests=64, plugin_manager=pm)
    report: dict = {"model": args.model, "functions": len(tool_suite.FUNCTIONS)}
    try:
        for grammar in (True, False):
            st = ServerState(engine=engine, settings=settings_from_dict({"model": {"tool_grammar": grammar}}),
                             model_name="m", api_keys=[], plugins=pm)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(st)), base_url="http://t",
                                         timeout=3600) as c:
                key = "grammar" if grammar else "no_grammar"
                runs = []
                if grammar:
                    runs += [await validity(c, choice="required", temperature=t, shot=False, max_tokens=args.max_tokens)
                             for t in (0.0, 1.0)]
                runs += [await validity(c, choice="auto", temperature=t, shot=True, max_tokens=args.max_tokens)
                         for t in (0.0, 1.0)]
                for r in runs:
                    print(json.dumps({key: r}), flush=True)
                report[key] = runs
                if grammar:
                    report["latency"] = await latency(c, list(tool_suite.FUNCTIONS)[:args.latency_functions])
                    print(json.dumps({"latency": {k: v for k, v in report["latency"].items() if k != "runs"}}))
    finally:
        await engine.stop()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "tool_calls" / "tool_calls.json"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--latency-functions", type=int, default=8)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    report["environment"] = environment()
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
