"""Overload and soak: many streaming clients at once against one server, through one aiohttp
session (its connector unbounded, so a thousand clients hold a thousand connections).

Every client has a deadline. Each one ends as exactly one of:

    completed  200, an SSE stream ending in ``[DONE]`` whose text equals ``expect`` (when given)
               and whose choices all finished
    refused    429 or 503 with OpenAI's error JSON (``{"error": {...}}``)
    failed     anything else: another status, a malformed stream, a reset, the deadline

The figures (``summary``) are what ``BENCHMARKS.md`` records: sent, completed, refused,
failed, TTFT percentiles of the completed ones, refusal latency percentiles.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

import aiohttp

from radixd.bench.targets import body_lines


@dataclass
class Outcome:
    kind: str                       # completed | refused | failed
    status: int | None = None
    error: str | None = None        # the error code (refused) or what went wrong (failed)
    ttft_ms: float | None = None    # first text (completed)
    total_ms: float = 0.0           # until the end of the response (or the failure)
    text: str = ""


def _session(url: str, headers: dict[str, str] | None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(url, headers=headers or {}, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def one_client(session: aiohttp.ClientSession, path: str, body: dict, *, deadline_s: float,
                     expect: str | None = None) -> Outcome:
    """One streaming request (``body`` must ask for ``"stream": true``)."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s), session.post(path, json=body) as resp:
            if resp.status != 200:
                raw = await resp.read()
                ms = (time.perf_counter() - t0) * 1000
                try:
                    err = json.loads(raw)["error"]
                    code = err["code"]
                    assert err["message"] and err["type"]
                except (ValueError, KeyError, TypeError, AssertionError):
                    return Outcome("failed", resp.status, f"status {resp.status} without error JSON: {raw[:200]!r}",
                                   total_ms=ms)
                return Outcome("refused" if resp.status in (429, 503) else "failed", resp.status, code, total_ms=ms)
            return await _stream(resp, t0, expect)
    except TimeoutError:
        return Outcome("failed", None, f"deadline of {deadline_s} s", total_ms=(time.perf_counter() - t0) * 1000)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return Outcome("failed", None, f"{type(exc).__name__}: {exc}", total_ms=(time.perf_counter() - t0) * 1000)


async def _stream(resp: aiohttp.ClientResponse, t0: float, expect: str | None) -> Outcome:
    ttft = None
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    done = False
    async for line in body_lines(resp.content):
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            continue
        msg = json.loads(payload)
        for c in msg.get("choices", []):
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c.get("finish_reason"):
                reasons[c["index"]] = c["finish_reason"]
    total = (time.perf_counter() - t0) * 1000
    if not done:
        return Outcome("failed", 200, "the stream ended without [DONE]", total_ms=total)
    if not texts or any(reasons.get(i) not in ("stop", "length") for i in texts):
        return Outcome("failed", 200, f"unfinished choices: {reasons}", total_ms=total)
    text = texts[min(texts)]
    if expect is not None and text != expect:
        return Outcome("failed", 200, f"wrong text {text[:60]!r}", total_ms=total, text=text)
    return Outcome("completed", 200, ttft_ms=ttft, total_ms=total, text=text)


async def storm(url: str, clients: int, body: dict, *, path: str = "/v1/completions",
                headers: dict[str, str] | None = None, deadline_s: float = 120.0,
                expect: str | None = None) -> list[Outcome]:
    """``clients`` requests started at once; their outcomes in order."""
    async with _session(url, headers) as session:
        return list(await asyncio.gather(*(one_client(session, path, body, deadline_s=deadline_s, expect=expect)
                                           for _ in range(clients))))


async def closed_loop(url: str, total: int, concurrency: int, body: dict, *, path: str = "/v1/completions",
                      headers: dict[str, str] | None = None, deadline_s: float = 120.0, expect: str | None = None,
                      every: int = 0, probe=None) -> tuple[list[Outcome], list]:
    """``total`` requests through ``concurrency`` workers (a soak). ``probe()`` (sync) is
    called after every ``every`` finished requests; its results are returned too."""
    outcomes: list[Outcome] = []
    probes = []
    it = iter(range(total))

    async with _session(url, headers) as session:
        async def worker():
            for _ in it:
                outcomes.append(await one_client(session, path, body, deadline_s=deadline_s, expect=expect))
                if every and probe is not None and len(outcomes) % every == 0:
                    probes.append(await asyncio.to_thread(probe))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, probes


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def summary(outcomes: list[Outcome]) -> dict:
    done = [o for o in outcomes if o.kind == "completed"]
    refused = [o for o in outcomes if o.kind == "refused"]
    failed = [o for o in outcomes if o.kind == "failed"]
    ttft = [o.ttft_ms for o in done if o.ttft_ms is not None]
    refusal = [o.total_ms for o in refused]
    r = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "sent": len(outcomes), "completed": len(done), "refused": len(refused), "failed": len(failed),
        "refused_by": {code: sum(o.error == code for o in refused) for code in sorted({o.error for o in refused})},
        "failures": [asdict(o) for o in failed[:10]],
        "ttft_ms": {"p50": r(percentile(ttft, 50)), "p99": r(percentile(ttft, 99)), "max": r(max(ttft, default=None))},
        "e2e_ms": {"p50": r(percentile([o.total_ms for o in done], 50)),
                   "p99": r(percentile([o.total_ms for o in done], 99))},
        "refusal_ms": {"p50": r(percentile(refusal, 50)), "p99": r(percentile(refusal, 99)),
                       "max": r(max(refusal, default=None))},
    }
