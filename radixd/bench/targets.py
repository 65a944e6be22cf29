"""Targets of ``radixd bench``: a server over HTTP (streaming; latencies measured by the
client), the in-process ``radixd.Engine``, and transformers' ``generate()`` (the naive peer).

Each target turns a ``RequestSpec`` into a ``Record``; a refused or dropped request becomes
a record with ``ok = False`` and its error, never an exception.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from radixd.bench.workloads import RequestSpec

APIS = ("native", "completions", "chat")


class TargetError(Exception):
    """The target cannot be used at all (unreachable, refuses every call, fails to load)."""


@dataclass
class Record:
    """What one request did, as the client saw it. Times in milliseconds; ``start_ms`` from
    the start of the run, the others from the moment the request was sent."""

    session: int
    turn: int
    group: int | None
    prompt_tokens: int          # tokens the client sent (chat: the messages' content, no template)
    max_tokens: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    start_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0      # tokens received (usage's count where the route reports it)
    chunks: int = 0             # streamed events that carried tokens
    output_ids: list[int] | None = None
    output_text: str = ""
    finish_reason: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["tpot_ms"] = self.tpot_ms
        return d


def new_record(spec: RequestSpec) -> Record:
    return Record(spec.session, spec.turn, spec.group, len(spec.input_ids), spec.output_len)


class _Clock:
    """Token arrival times of one request: TTFT, inter-token gaps, end to end."""

    def __init__(self, rec: Record):
        self.rec = rec
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.rec.ttft_ms = (now - self.t0) * 1000
        else:
            self.rec.itl_ms.append((now - self.last) * 1000)
        self.last = now
        self.rec.chunks += 1

    def end(self) -> None:
        self.rec.e2e_ms = (time.perf_counter() - self.t0) * 1000


class Target:
    kind = "?"

    async def start(self) -> dict:
        """Connect or load; return what the JSON report says about the target."""
        return {}

    async def request(self, spec: RequestSpec, ignore_eos: bool = True) -> Record:
        raise NotImplementedError

    async def cache_counters(self) -> dict | None:
        """{'prompt_tokens', 'cached_tokens', 'source'} now, or None without a cache."""
        return None

    async def flush_cache(self) -> bool:
        return False

    async def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------ http


class HttpTarget(Target):
    """A server's streaming routes through aiohttp, whose C parser keeps the client's cost per
    streamed event near 40-50 µs of CPU (httpx's pure-Python stack took about 200 µs here:
    at a GPU's 5,000 events a second the client itself was the bottleneck)."""

    kind = "http"

    def __init__(self, url: str, api: str, *, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_connections: int | None = None, min_tokens: bool = False,
                 keepalive_s: float = 4.0):
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}")
        self.url = url.rstrip("/")
        self.api = api
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.max_connections = max_connections
        self.min_tokens = min_tokens  # OpenAI routes: also ask for min_tokens = the output length
        # A pooled connection idle longer than this is dropped, not reused: servers close idle
        # keep-alive connections (hypercorn's and uvicorn's default: after 5 s), and a close
        # that came while this process was busy in synchronous code (a tokenizer, the prompts)
        # is not read yet, so the connection looks alive and the request written into it fails
        self.keepalive_s = keepalive_s
        self.session = None

    async def _get(self, path: str) -> tuple[int, str]:
        import aiohttp

        async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            return r.status, await r.text()

    async def start(self) -> dict:
        import aiohttp

        self.session = aiohttp.ClientSession(
            self.url, headers=self.headers,
            # (a read timeout between events, as a stream may run for long; 0: no connection limit)
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.timeout),
            connector=aiohttp.TCPConnector(limit=self.max_connections or 0, keepalive_timeout=self.keepalive_s))
        try:
            status, text = await self._get("/v1/models")
        except (aiohttp.ClientError, TimeoutError) as exc:
            await self.session.close()
            raise TargetError(f"cannot reach {self.url}: {_why(exc)}") from None
        if status in (401, 403):
            await self.session.close()
            raise TargetError(f"{self.url} refused the API key (HTTP {status}); give --api-key")
        served = None
        if status == 200:
            try:
                served = json.loads(text)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                served = None
        if self.model is None:
            self.model = served
        info = {"url": self.url, "api": self.api, "model": self.model}
        try:  # radixd (and SGLang) describe themselves here
            status, text = await self._get("/server_info")
            if status == 200:
                body = json.loads(text)
                info["server_info"] = {k: body.get(k) for k in ("version", "model", "device", "dtype", "context_len",
                                                                 "settings", "plugins")}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return info

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def cache_counters(self) -> dict | None:
        import aiohttp

        try:
            status, text = await self._get("/metrics")
        except (aiohttp.ClientError, TimeoutError):
            return None
        if status != 200:
            return None
        vals = parse_prometheus(text)
        if "radixd_prompt_tokens_total" not in vals or "radixd_cached_prompt_tokens_total" not in vals:
            return None
        return {"prompt_tokens": vals["radixd_prompt_tokens_total"],
                "cached_tokens": vals["radixd_cached_prompt_tokens_total"], "source": "server /metrics"}

    async def flush_cache(self) -> bool:
        import aiohttp

        for _ in range(20):
            try:
                async with self.session.post("/flush_cache", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                    status = r.status
                    await r.read()
            except (aiohttp.ClientError, TimeoutError):
                return False
            if status == 200:
                return True
            if status != 400:  # a server without the route
                return False
            await asyncio.sleep(0.25)  # 400: the cache is in use; wait for the last requests to leave
        return False

    def _body(self, spec: RequestSpec, ignore_eos: bool) -> tuple[str, dict]:
        if self.api == "native":
            sp = {"max_new_tokens": spec.output_len, "temperature": 0.0}
            if ignore_eos:
                sp["ignore_eos"] = True
            return "/generate", {"input_ids": spec.input_ids, "sampling_params": sp, "stream": True}
        body: dict = {"max_tokens": spec.output_len, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if ignore_eos:
            body["ignore_eos"] = True
            if self.min_tokens:
                body["min_tokens"] = spec.output_len
        if self.api == "completions":
            return "/v1/completions", {**body, "prompt": spec.input_ids}
        return "/v1/chat/completions", {**body, "messages": spec.messages}

    async def request(self, spec: RequestSpec, ignore_eos: bool = True) -> Record:
        import aiohttp

        rec = new_record(spec)
        path, body = self._body(spec, ignore_eos)
        clock = _Clock(rec)
        done = False
        try:
            async with self.session.post(path, json=body) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    text = (await resp.read()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status}: {_error_message(text)}"
                    clock.end()
                    return rec
                async for line in body_lines(resp.content):
                    if not line.startswith("data:"):
                        continue  # blank separators, ": ping" comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        rec.error = f"unreadable event: {data[:200]}"
                        break
                    if "error" in event:
                        rec.error = f"error event: {_error_message(data)}"
                        break
                    self._event(event, rec, clock)
        except (aiohttp.ClientError, TimeoutError) as exc:
            rec.error = f"{type(exc).__name__}: {_why(exc)}"
        clock.end()
        if rec.error is None and not done:
            rec.error = "the stream ended without [DONE]"
        if rec.error is None and rec.finish_reason == "abort":
            rec.error = "the server aborted the request"
        if rec.error is None:
            rec.ok = True
            if rec.output_ids is not None:
                rec.output_tokens = len(rec.output_ids)
            elif rec.usage_completion_tokens is not None:
                rec.output_tokens = rec.usage_completion_tokens
            else:
                rec.output_tokens = rec.chunks
        return rec

    def _event(self, event: dict, rec: Record, clock: _Clock) -> None:
        if self.api == "native":
            ids = event.get("output_ids") or []
            seen = len(rec.output_ids or [])
            clock.tokens(len(ids) - seen)
            rec.output_ids = list(ids)
            rec.output_text = event.get("text", rec.output_text)
            meta = event.get("meta_info") or {}
            if meta.get("finish_reason") is not None:  # SGLang's object: {"type": ..., ...}
                rec.finish_reason = meta["finish_reason"]["type"]
            rec.usage_prompt_tokens = meta.get("prompt_tokens", rec.usage_prompt_tokens)
            rec.usage_completion_tokens = meta.get("completion_tokens", rec.usage_completion_tokens)
            rec.usage_cached_tokens = meta.get("cached_tokens", rec.usage_cached_tokens)
            return
        usage = event.get("usage")
        if usage:
            rec.usage_prompt_tokens = usage.get("prompt_tokens")
            rec.usage_completion_tokens = usage.get("completion_tokens")
            rec.usage_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices") or []:
            if self.api == "chat":
                delta = choice.get("delta") or {}
                if "role" in delta:  # the opening chunk carries no token
                    continue
                rec.output_text += delta.get("content") or ""
            else:
                rec.output_text += choice.get("text") or ""
            clock.tokens(1)
            if choice.get("finish_reason") is not None:
                rec.finish_reason = choice["finish_reason"]


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: name -> value."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


async def body_lines(content) -> AsyncIterator[str]:
    """A response body's lines as they arrive (no limit on a line's length, as an event
    carrying a long output's ids or text can be long)."""
    buf = b""
    async for chunk in content.iter_any():
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


def _why(exc: BaseException) -> str:
    msg = str(exc).strip()
    return msg or type(exc).__name__


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or json.dumps(err)
        else:
            msg = str(err)
    except (ValueError, AttributeError):
        msg = text
    return msg.strip()[:300]


# ---------------------------------------------------------------------------------- engine


class EngineTarget(Target):
    """The in-process ``radixd.Engine``: no HTTP, token ids in and out."""

    kind = "engine"

    def __init__(self, model: str = "default", **overrides):
        self.model = model
        self.overrides = overrides
        self.engine = None

    async def start(self) -> dict:
        from radixd import Engine
        from radixd.core.errors import ConfigError

        try:
            self.engine = await asyncio.to_thread(Engine, model=self.model, **self.overrides)
        except (ConfigError, TypeError):  # a bad --engine-arg: the caller says so
            raise
        except Exception as exc:  # a missing or unreadable model
            raise TargetError(f"cannot load the model {self.model!r}: {exc}") from None
        await self.engine.start()
        e = self.engine
        return {"model": str(e.model_path), "device": str(e.device), "dtype": str(e.dtype).removeprefix("torch."),
                "context_len": e.context_len, "kv_pool_tokens": e.allocator.total,
                "max_running_requests": e.config.max_running_requests, "policy": e.config.policy,
                "radix_cache": e.config.radix_cache, "overrides": self.overrides}

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None

    async def cache_counters(self) -> dict | None:
        st = self.engine.stats()
        return {"prompt_tokens": st["cache_queried_tokens"], "cached_tokens": st["cache_hit_tokens"],
                "source": "engine.stats()"}

    async def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    async def request(self, spec: RequestSpec, ignore_eos: bool = True) -> Record:
        from radixd.core.errors import EngineStopped, InvalidRequest
        from radixd.core.sampling_params import SamplingParams

        rec = new_record(spec)
        clock = _Clock(rec)
        ids: list[int] = []
        try:
            params = SamplingParams(max_new_tokens=spec.output_len, temperature=0.0, ignore_eos=ignore_eos)
            sub = self.engine.submit(input_ids=spec.input_ids, params=params)
            try:
                async for out in sub:
                    clock.tokens(len(out.token_ids))
                    ids.extend(out.token_ids)
                    rec.output_text += out.text
                    if out.finished:
                        rec.finish_reason = out.finish_reason
                        rec.usage_prompt_tokens = out.prompt_tokens
                        rec.usage_completion_tokens = out.completion_tokens
                        rec.usage_cached_tokens = out.cached_tokens
            finally:
                sub.close()
        except (InvalidRequest, EngineStopped, RuntimeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        clock.end()
        rec.output_ids = ids
        if rec.error is None and rec.finish_reason == "abort":
            rec.error = "the engine aborted the request"
        if rec.error is None:
            rec.ok = True
            rec.output_tokens = len(ids)
        return rec


# -------------------------------------------------------------------------------------- hf


class HFTarget(Target):
    """transformers ``generate()`` on the same model: requests are batched as they arrive (up to
    ``batch_size``, left padding, greedy); a batch runs to its longest request before the next
    one starts. Token times are taken at each decoding step inside ``generate()``, as a
    streamer would see them."""

    kind = "hf"

    def __init__(self, model: str = "default", batch_size: int = 8):
        self.model_name = model
        self.batch_size = batch_size
        self.model = None
        self._pending: list[tuple[RequestSpec, bool, float, asyncio.Future]] = []
        self._kick: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> dict:
        try:
            await asyncio.to_thread(self._load)
        except Exception as exc:
            raise TargetError(f"cannot load the model {self.model_name!r} with transformers: {exc}") from None
        self._kick = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._batcher())
        import torch
        import transformers

        return {"model": str(self.path), "device": "cpu", "dtype": "float32", "batch_size": self.batch_size,
                "transformers": transformers.__version__, "torch_threads": torch.get_num_threads()}

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from radixd.core.model_loader import resolve_model

        self.path = resolve_model(self.model_name)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32).eval()
        gc = self.model.generation_config
        eos = gc.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad = gc.pad_token_id if gc.pad_token_id is not None else (min(self.eos) if self.eos else 0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for *_, fut in self._pending:
            if not fut.done():
                fut.cancel()
        self.model = None

    async def request(self, spec: RequestSpec, ignore_eos: bool = True) -> Record:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((spec, ignore_eos, time.perf_counter(), fut))
        self._kick.set()
        return await fut

    async def _batcher(self) -> None:
        while True:
            await self._kick.wait()
            for _ in range(3):  # let requests sent at the same moment join the batch
                await asyncio.sleep(0)
            self._kick.clear()
            while self._pending:
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size:]
                try:
                    results = await asyncio.to_thread(self._generate, batch)
                except Exception as exc:  # one failing batch fails its requests only
                    results = [exc] * len(batch)
                for (spec, _, t_sent, fut), res in zip(batch, results, strict=True):
                    if not fut.done():
                        fut.set_result(self._record(spec, t_sent, res))

    def _generate(self, batch) -> list:
        import copy

        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        steps: list[float] = []

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                steps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        prompts = [spec.input_ids for spec, *_ in batch]
        ignore_eos = all(ie for _, ie, *_ in batch)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gc = copy.deepcopy(self.model.generation_config)
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        gc.max_new_tokens = max(spec.output_len for spec, *_ in batch)
        gc.min_new_tokens = None
        gc.pad_token_id = self.pad
        # ignore_eos: [] (None would fall back to the model's default EOS and stop there)
        gc.eos_token_id = [] if ignore_eos else sorted(self.eos)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                      stopping_criteria=StoppingCriteriaList([Stamp()]))
        results = []
        for row, (spec, ie, *_) in enumerate(batch):
            toks = out[row, width:].tolist()[: spec.output_len]
            stopped = False
            if not ie:
                for i, t in enumerate(toks):
                    if t in self.eos:
                        toks, stopped = toks[: i + 1], True
                        break
            results.append((toks, steps[: len(toks)], stopped))
        return results

    def _record(self, spec: RequestSpec, t_sent: float, res) -> Record:
        rec = new_record(spec)
        if isinstance(res, BaseException):
            rec.error = f"{type(res).__name__}: {res}"
            rec.e2e_ms = (time.perf_counter() - t_sent) * 1000
            return rec
        toks, stamps, stopped = res
        rec.ok = True
        rec.output_ids = toks
        rec.output_tokens = len(toks)
        rec.chunks = len(toks)
        rec.finish_reason = "stop" if stopped else "length"
        if stamps:
            rec.ttft_ms = (stamps[0] - t_sent) * 1000
            rec.itl_ms = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]
            rec.e2e_ms = (stamps[-1] - t_sent) * 1000
        else:
            rec.e2e_ms = (time.perf_counter() - t_sent) * 1000
        return rec
