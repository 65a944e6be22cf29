"""radixd.lang ``run_batch``: 64 two-turn programs sharing a system prompt, radix cache on vs off.

Each program: a shared system prompt (about 400 tokens), a user question of its own, a
generated answer, a follow-up question and a second answer (greedy, ``ignore_eos``), on the
in-process engine (``EngineRuntime``) with the default model, CPU. Reports wall time,
programs/s, generated tokens/s and the cache hit rate (cached / prompt tokens over every call).

    python -m benchmarks.lang_batch --out benchmarks/results/lang_batch/lang_batch.json
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import RESULTS, environment, write_json
from radixd.lang import EngineRuntime, assistant, function, gen, system, user

SYSTEM = ("You are the support assistant of a hardware shop. " + " ".join(
    f"Rule {i}: answer politely, cite the relevant policy number, never invent stock levels, and keep "
    f"answers short unless the customer asks for detail." for i in range(1, 19)))

TOPICS = ["returns", "warranty", "shipping", "invoices", "gift cards", "repairs", "discounts", "opening hours"]


@function
def support(s, topic, n):
    s += system(SYSTEM)
    s += user(f"Customer {n} asks about {topic}. What should they know?")
    s += assistant(gen("a1", max_tokens=12, temperature=0, ignore_eos=True))
    s += user("Can you say that more simply?")
    s += assistant(gen("a2", max_tokens=12, temperature=0, ignore_eos=True))


def run(radix: bool, programs: int, threads: int, model: str) -> dict:
    rt = EngineRuntime(model=model, radix_cache=radix, kv_cache_tokens=65536, max_running_requests=64)
    try:
        support.run(backend=rt, topic="warm-up", n=-1)
        rt.engine.flush_cache()
        args = [{"topic": TOPICS[i % len(TOPICS)], "n": i} for i in range(programs)]
        t0 = time.perf_counter()
        states = support.run_batch(args, backend=rt, num_threads=threads)
        wall = time.perf_counter() - t0
    finally:
        rt.close()
    metas = [st.get_meta_info(k) for st in states for k in ("a1", "a2")]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    gen_tokens = sum(m["completion_tokens"] for m in metas)
    return {"radix_cache": radix, "programs": programs, "threads": threads, "seconds": round(wall, 2),
            "programs_per_s": round(programs / wall, 3), "gen_tok_s": round(gen_tokens / wall, 1),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "lang_batch" / "lang_batch.json"))
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    rows = []
    for radix in (True, False):
        r = run(radix, args.programs, args.threads, args.model)
        print(json.dumps(r), flush=True)
        rows.append(r)
    on, off = rows
    report = {"runs": rows, "on_over_off": round(off["seconds"] / on["seconds"], 2),
              "environment": environment()}
    print(json.dumps({"on_over_off": report["on_over_off"]}))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
