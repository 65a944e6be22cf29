"""Drive a target through a workload: arrivals (all at once, or Poisson at a rate), a
concurrency bound, turns of a conversation in order, a progress bar; and the greedy check
(engine against the hf peer)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import sys
import time
from collections.abc import Iterator

from radixd.bench.targets import Record, Target
from radixd.bench.workloads import Workload
from radixd.core import gc_control
from radixd.core.gc_control import GcPauses


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``n`` sessions arrives: all at 0 for an infinite
    rate, else a Poisson process (exponential gaps of mean 1 / rate), the first at 0."""
    if not (math.isfinite(request_rate) and request_rate > 0):
        return [0.0] * n
    rng = random.Random(seed * 1_000_003 + 17)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


@contextlib.contextmanager
def quiet_collector() -> Iterator[GcPauses]:
    """The client's own garbage collector while a run is timed: what exists before it (the
    tokenizer, the workload, the libraries: a few hundred thousand objects) is frozen, so a
    full collection walks only what the run made, and the collections the run sees are counted.

    A full collection of the unfrozen heap stops the client's event loop for 100 ms or more,
    and every stream in flight records that stop as one long inter-token gap; the in-process
    engine target's engine freezes the same heap while it runs. The freeze is taken and given
    back as an engine's is (``gc_control``), so an engine still running keeps its own."""
    gc.collect()
    gc_control.acquire(freeze=True, threshold=0)
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses.callback)
        gc_control.release()


async def run_once(target: Target, workload: Workload, *, request_rate: float = math.inf,
                   max_concurrency: int | None = None, seed: int = 0, ignore_eos: bool = True,
                   progress: bool = True, desc: str = "") -> tuple[list[Record], float]:
    """Send every turn of every session; return the records (in completion order) and the
    duration from the first arrival to the last reply."""
    from tqdm import tqdm

    arrivals = arrival_times(len(workload.sessions), request_rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[Record] = []
    bar = tqdm(total=workload.num_requests, desc=desc or workload.name, unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True, mininterval=0.5)
    t0 = time.perf_counter()

    async def session(sess, at: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outputs: list[tuple[list[int] | None, str]] = []
        for k in range(len(sess.turns)):
            spec = workload.spec(sess, k, outputs)
            if sem is not None:
                async with sem:
                    rec = await _send(target, spec, ignore_eos, t0)
            else:
                rec = await _send(target, spec, ignore_eos, t0)
            records.append(rec)
            bar.update(1)
            if not rec.ok:  # a conversation whose turn failed goes no further
                bar.update(len(sess.turns) - k - 1)
                break
            outputs.append((rec.output_ids, rec.output_text))

    try:
        await asyncio.gather(*(session(s, a) for s, a in zip(workload.sessions, arrivals, strict=True)))
    finally:
        bar.close()
    return records, time.perf_counter() - t0


async def _send(target: Target, spec, ignore_eos: bool, t0: float) -> Record:
    start = time.perf_counter()
    try:
        rec = await target.request(spec, ignore_eos)
    except Exception as exc:  # a target bug must not end the run: count it
        from radixd.bench.targets import new_record

        rec = new_record(spec)
        rec.error = f"{type(exc).__name__}: {exc}"
        rec.e2e_ms = (time.perf_counter() - start) * 1000
    rec.start_ms = (start - t0) * 1000
    return rec


async def warmup(target: Target, spec, n: int, ignore_eos: bool) -> str | None:
    """``n`` short requests before timing; the first error, if any."""
    for _ in range(n):
        rec = await target.request(spec, ignore_eos)
        if not rec.ok:
            return rec.error
    return None


async def check_greedy(model: str, workload: Workload, n: int, *, hf_batch_size: int, ignore_eos: bool,
                       progress: bool = True) -> dict:
    """The first ``n`` prompts through the engine and through transformers, greedily: are the
    output token ids identical?"""
    from radixd.bench.targets import EngineTarget, HFTarget

    specs = [workload.spec(s, 0, []) for s in workload.sessions[:n]]
    outs: dict[str, list[Record]] = {}
    for name, target in (("engine", EngineTarget(model)), ("hf", HFTarget(model, batch_size=hf_batch_size))):
        await target.start()
        try:
            if progress:
                print(f"radixd bench: greedy check, {len(specs)} prompts through {name}", file=sys.stderr)
            outs[name] = list(await asyncio.gather(*(target.request(s, ignore_eos) for s in specs)))
        finally:
            await target.close()
    prompts = []
    for i, (spec, a, b) in enumerate(zip(specs, outs["engine"], outs["hf"], strict=True)):
        item = {"prompt": i, "prompt_tokens": len(spec.input_ids), "engine_ok": a.ok, "hf_ok": b.ok,
                "engine_ids": a.output_ids, "hf_ids": b.output_ids, "identical": a.ok and b.ok and a.output_ids == b.output_ids}
        if not item["identical"] and a.ok and b.ok:
            item["first_difference"] = next(
                (k for k, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)) if x != y),
                min(len(a.output_ids), len(b.output_ids)))
        if not (a.ok and b.ok):
            item["error"] = a.error or b.error
        prompts.append(item)
    return {"model": model, "prompts": len(prompts), "identical": sum(p["identical"] for p in prompts),
            "all_identical": all(p["identical"] for p in prompts), "per_prompt": prompts}
