"""Hierarchical KV cache on a multi-turn workload: pool only vs + host vs + host + disk vs
+ host + Redis, in-process, one engine per configuration, the same seeded conversations.

    python3 -m benchmarks.kv_tiers --preset cpu  --out DIR     # default model, CPU, all four
    python3 -m benchmarks.kv_tiers --preset h200 --out DIR     # Llama-3-8B shape, random weights, CUDA:
                                                          # pool vs + host (~3 min)

Each conversation sends its turns in order (turn k's prompt = every earlier turn, its reply
and the new user tokens), all conversations at once, a bounded number of requests in flight;
the KV pool is sized to a fraction of
the working set, so earlier turns are evicted and either recomputed (pool only) or loaded
back from the tiers. Per configuration: TTFT mean/p50/p99, input and output token
throughput, wall time, prompt tokens served from the pool and from the tiers, per-tier
counters; and whether every configuration produced the pool-only run's output tokens.
With ``--rounds R`` every configuration runs R times (every other round in reverse order)
and TTFT is pooled over all its requests. Writes DIR/kv_tiers.json and DIR/kv_tiers.log. The Redis configuration needs `redis-server`
on PATH and `pip install ./plugins-contrib/radixd-redis`; it is skipped (and said so) otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, Log, RedisServer, checkpoint_dir, environment, write_json
from radixd import Engine, SamplingParams

PRESETS = {
    # SmolLM2-135M on CPU (fp32: 45 KB of KV per token): 8 conversations x 4 turns of 192 user
    # + 8 reply tokens, 2 requests in flight -> a working set of ~6.4k tokens over a
    # 2048-token pool; the host tier holds ~2/3 of it, so disk and Redis keep pages it lost.
    # Two rounds (the second in reverse order): this machine's timing noise is large.
    "cpu": dict(model="default", device="cpu", conversations=8, turns=4, turn_len=192, output_len=8, rounds=2,
                concurrency=2, pool_tokens=2048, page_tokens=16, host_tokens=4096,
                configs="pool,host,host+disk,host+redis"),
    # Llama-3-8B shape on one H200 (bf16: 128 KB of KV per token): 30 conversations x 4
    # turns of 1024 + 32 -> ~127k tokens over a 24k-token pool (5 requests of up to 4.2k
    # tokens in flight fit it without preemption); the host tier (a 16 GiB page-locked
    # slab, 131072 tokens) holds it all.
    "h200": dict(model="llama3-8b", device="cuda", conversations=30, turns=4, turn_len=1024, output_len=32,
                 concurrency=5, rounds=1, pool_tokens=24576, page_tokens=64, host_tokens=131072,
                 configs="pool,host"),
    # The h200 logic at toy size on CPU (to check the script, not to measure).
    "smoke": dict(model="tiny", device="cpu", conversations=4, turns=3, turn_len=48, output_len=4,
                  concurrency=2, rounds=1, pool_tokens=256, page_tokens=8, host_tokens=256, configs="pool,host,host+disk,host+redis"),
}


def model_dir(name: str, tmp: Path) -> tuple[str, dict]:
    """(model argument, extra engine arguments) for a preset's model."""
    if name == "default":
        return "default", {}
    shape = dict(SHAPES["llama3-8b"])
    if name == "tiny":
        shape.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=4096, max_position_embeddings=2048)
    return checkpoint_dir(shape, where=tmp / name), {"load_format": "dummy", "tokenizer": "none"}


def conversations(n: int, turns: int, turn_len: int, seed: int, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(100, vocab) for _ in range(turn_len)] for _ in range(turns)] for _ in range(n)]


async def run_config(eng: Engine, chats, output_len: int, concurrency: int) -> dict:
    """Every conversation at once, its turns in order, at most ``concurrency`` requests in
    flight (a turn waits for a free place; TTFT is counted from when it is sent)."""
    records: list[dict] = []
    gate = asyncio.Semaphore(concurrency)

    async def session(c: int, turns: list[list[int]]) -> list[int]:
        history: list[int] = []
        outs: list[int] = []
        for k, user in enumerate(turns):
            prompt = history + user
            params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
            async with gate:
                t0 = time.perf_counter()
                ttft, toks, cached = None, [], 0
                async for out in eng.generate(input_ids=prompt, params=params):
                    if ttft is None and out.token_ids:
                        ttft = time.perf_counter() - t0
                    toks += out.token_ids
                    cached = out.cached_tokens
            records.append({"conversation": c, "turn": k, "prompt_tokens": len(prompt), "output_tokens": len(toks),
                            "cached_tokens": cached, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0})
            history = prompt + toks
            outs += toks
        return outs

    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(session(c, t) for c, t in enumerate(chats)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in records)
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "wall_s": wall,
        "input_tok_per_s": sum(r["prompt_tokens"] for r in records) / wall,
        "output_tok_per_s": sum(r["output_tokens"] for r in records) / wall,
        "requests": len(records),
        "records": records,
        "outputs": outputs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--configs", default=None, help="comma-separated subset of pool,host,host+disk,host+redis")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--turn-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--pool-tokens", type=int, default=None)
    ap.add_argument("--host-tokens", type=int, default=None, help="host tier size, in tokens of KV")
    ap.add_argument("--page-tokens", type=int, default=None)
    ap.add_argument("--write-policy", default="write_back")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="CUDA only: float32 to check that +host reproduces pool-only's tokens (bf16 rounding "
                         "may legitimately differ when a prompt is split differently)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run every configuration this many times, order reversed every other round")
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    for key in ("rounds", "configs", "conversations", "turns", "turn_len", "output_len", "concurrency", "pool_tokens",
                "host_tokens", "page_tokens"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_tiers.log").write_text("")
    log = Log(out / "kv_tiers.log")
    tmp = Path(tempfile.mkdtemp(prefix="radixd-kv-tiers-"))
    model, extra = model_dir(p["model"], tmp)
    if p["device"] == "cuda":
        extra.update(dtype=args.dtype or "bfloat16", max_running_requests=64, max_prefill_tokens=16384, chunked_prefill_size=8192)
    else:
        extra.update(dtype="float32", attention_backend="torch", max_running_requests=max(8, p["conversations"]))
    vocab = 4096 if p["model"] == "tiny" else 40000
    chats = conversations(p["conversations"], p["turns"], p["turn_len"], args.seed, vocab)
    log(f"radixd kv tiers bench: preset {args.preset}, {json.dumps({k: v for k, v in p.items()})}")
    if p["device"] == "cuda":
        log(f"device: {torch.cuda.get_device_name(0)}")
    report = {"preset": args.preset, "params": p, "write_policy": args.write_policy, "environment": environment(),
              "device": torch.cuda.get_device_name(0) if p["device"] == "cuda" else "cpu", "configs": {}}
    redis = None
    names = p["configs"].split(",")
    order = [(r, n) for r in range(p["rounds"]) for n in (names if r % 2 == 0 else names[::-1])]
    report["order"] = [f"{n}#{r}" for r, n in order]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    reference = None  # output tokens of the first pool-only run
    try:
        for rnd, name in order:
            tiers = () if name == "pool" else tuple(name.split("+"))
            opts: dict = {}
            if "host" in tiers:
                opts["host"] = {"max_bytes": p["host_tokens"] * _kv_bytes_per_token(model, extra)}
            if "disk" in tiers:
                opts["disk"] = {"path": str(tmp / f"disk-{name}-{rnd}")}
            if "redis" in tiers:
                exe = shutil.which("redis-server")
                try:
                    import radixd_redis  # noqa: F401
                except ImportError:
                    exe = None
                if exe is None:
                    log(f"{name}: skipped (needs redis-server on PATH and plugins-contrib/radixd-redis installed)")
                    runs[name].append({"skipped": "redis-server or radixd-redis missing"})
                    continue
                redis = RedisServer(exe, tmp, maxmemory="8gb")
                opts["redis"] = {"url": redis.url, "timeout_s": 2.0}
            kw = dict(extra, device=p["device"], kv_cache_tokens=p["pool_tokens"], cache_tiers=tiers,
                      cache_page_tokens=p["page_tokens"], cache_write_policy=args.write_policy)
            t_load = time.perf_counter()
            eng = Engine(model=model, cache_tier_options=opts, **kw)
            load_s = time.perf_counter() - t_load
            res = asyncio.run(_run(eng, chats, p["output_len"], p["concurrency"]))
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if redis is not None:
                redis.kill()
                redis = None
            res["engine_load_s"] = load_s
            res["round"] = rnd
            if reference is None and name == "pool":
                reference = res["outputs"]
            res["outputs_equal_pool"] = res.pop("outputs") == reference if reference is not None else None
            runs[name].append(res)
            log(f"{name:11s}#{rnd} ttft mean {res['ttft_mean_s'] * 1000:8.1f} ms  p99 {res['ttft_p99_s'] * 1000:8.1f} ms"
                     f"  in {res['input_tok_per_s']:8.1f} tok/s  out {res['output_tok_per_s']:7.1f} tok/s  "
                     f"wall {res['wall_s']:6.1f} s  from pool {res['stats']['pool_hit_tokens']}  "
                     f"from tiers {res['stats']['tier_loaded_tokens']}  outputs = pool-only: {res['outputs_equal_pool']}")
            for tier, st in res["stats"]["cache_tiers"].items():
                log(f"{'':14s}{tier}: hits {st['hits']} pages, {st['tokens_loaded']} tokens, "
                         f"load {st['load_seconds_mean'] * 1000:.2f} ms/page, stores {st['stores']}, "
                         f"evictions {st['evictions']}, errors {st['errors']}, used {st['used_bytes'] / 2**20:.0f} MiB")
    finally:
        if redis is not None:
            redis.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    report["runs"] = runs
    summary = {}
    for name, rs in runs.items():
        done = [r for r in rs if "records" in r]
        if not done:
            summary[name] = {"skipped": True}
            continue
        ttfts = sorted(x["ttft_s"] for r in done for x in r["records"])
        summary[name] = {
            "runs": len(done),
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "ttft_mean_s_per_run": [r["ttft_mean_s"] for r in done],
            "input_tok_per_s": statistics.fmean(r["input_tok_per_s"] for r in done),
            "output_tok_per_s": statistics.fmean(r["output_tok_per_s"] for r in done),
            "wall_s": statistics.fmean(r["wall_s"] for r in done),
            "tier_loaded_tokens": done[0]["stats"]["tier_loaded_tokens"],
            "pool_hit_tokens": done[0]["stats"]["pool_hit_tokens"],
            "outputs_equal_pool": all(r["outputs_equal_pool"] for r in done),
        }
    if "ttft_mean_s" in summary.get("pool", {}):
        for s in summary.values():
            if "ttft_mean_s" in s:
                s["ttft_mean_speedup_vs_pool"] = summary["pool"]["ttft_mean_s"] / s["ttft_mean_s"]
    report["summary"] = summary
    write_json(out / "kv_tiers.json", report)
    log("summary (TTFT pooled over the rounds' requests):")
    for name, s in summary.items():
        if "ttft_mean_s" in s:
            log(f"  {name:11s} ttft mean {s['ttft_mean_s'] * 1000:8.1f} ms (x{s.get('ttft_mean_speedup_vs_pool', 1):.2f} "
                     f"vs pool)  p99 {s['ttft_p99_s'] * 1000:8.1f} ms  in {s['input_tok_per_s']:8.1f} tok/s  "
                     f"out {s['output_tok_per_s']:6.1f} tok/s  from tiers {s['tier_loaded_tokens']}  "
                     f"outputs = pool-only: {s['outputs_equal_pool']}")
    return 0


def _kv_bytes_per_token(model: str, extra: dict) -> int:
    from radixd.core.kv_pool import kv_bytes_per_token
    from radixd.core.model_loader import read_config, resolve_model

    cfg = read_config(resolve_model(model, None))
    dtype = torch.bfloat16 if extra.get("dtype") == "bfloat16" else torch.float32
    return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)


async def _run(eng: Engine, chats, output_len: int, concurrency: int) -> dict:
    try:
        await eng.start()
        # kernels compiled and first-use costs paid on an unrelated prompt, then forgotten
        warm = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        async for _ in eng.generate(input_ids=list(range(100, 100 + 3 * eng.config.cache_page_tokens)), params=warm):
            pass
        eng.flush_cache()
        res = await run_config(eng, chats, output_len, concurrency)
        st = eng.stats()
        if eng.tiers is not None:
            eng.tiers.flush()
            st = eng.stats()
        res["stats"] = {"pool_hit_tokens": st["cache_hit_tokens"] - st["tier_loaded_tokens"],
                        "tier_loaded_tokens": st["tier_loaded_tokens"], "preemptions": st["preemptions"],
                        "prefill_tokens": st["prefill_tokens"], "cache_tiers": st["cache_tiers"]}
        return res
    finally:
        await eng.stop()


if __name__ == "__main__":
    sys.exit(main())
