"""Where a program's calls run: a radixd daemon over HTTP, or an in-process ``Engine``.

A back end renders chat turns with the model's template, generates (streaming the text
through a callback) and scores ``select`` choices by the log-probability of their tokens
after the prompt (prompt logprobs; the shared prefix comes from the radix cache).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class BackendError(RuntimeError):
    """The server (or engine) refused or failed a call; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Choice:
    text: str
    logprob: float           # sum over the choice's tokens
    tokens: int

    @property
    def normalized(self) -> float:
        return self.logprob / self.tokens if self.tokens else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def choice_inputs(tokenize: Callable[[str], list[int]], text: str, choices: list[str]) -> list[tuple[list[int], int]]:
    """Each choice's prompt ``text + choice`` as token ids, and where its scored tokens start:
    after the tokens it shares with ``text`` alone (a merge across the boundary makes the
    merged token part of the choice); at least 1, since the first token has no logprob."""
    prefix = tokenize(text)
    out = []
    for c in choices:
        ids = tokenize(text + c)
        out.append((ids, max(1, min(common_prefix(prefix, ids), len(ids)))))
    return out


class RuntimeEndpoint:
    """A running radixd daemon (``url`` like ``http://127.0.0.1:8000``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict) -> Any:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise BackendError(_error_message(r.status_code, r.text), r.status_code)
        return r.json()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._post("/apply_chat_template", {"messages": messages,
                                                    "add_generation_prompt": add_generation_prompt})["text"]

    def tokenize(self, text: str) -> list[int]:
        return self._post("/v1/tokenize", {"prompt": text})["tokens"]

    def generate(self, text: str, params: dict, on_text: Callable[[str], None]) -> dict:
        body = {"text": text, "sampling_params": params, "stream": True}
        seen = ""
        meta: dict = {}
        with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                raise BackendError(_error_message(r.status_code, r.read().decode("utf-8", "replace")), r.status_code)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(event["error"].get("message", str(event["error"])))
                full = event["text"]
                if len(full) > len(seen):
                    on_text(full[len(seen):])
                    seen = full
                meta = event["meta_info"]
        return meta

    def select(self, text: str, choices: list[str]) -> list[Choice]:
        inputs = choice_inputs(self.tokenize, text, choices)
        answers = self._post("/generate", {
            "input_ids": [ids for ids, _ in inputs],
            "sampling_params": [{"max_new_tokens": 1, "temperature": 0, "prompt_logprobs_from": s} for _, s in inputs],
        })
        return [Choice(c, sum(a["meta_info"]["prompt_logprobs"]), len(a["meta_info"]["prompt_logprobs"]))
                for c, a in zip(choices, answers, strict=True)]


def _error_message(status: int, body: str) -> str:
    try:
        err = json.loads(body)["error"]
        return f"HTTP {status}: {err.get('message', err)}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:500]}"


class EngineRuntime:
    """An in-process ``Engine`` on its own event-loop thread (programs call from threads).

    Pass an engine's keyword arguments (``EngineRuntime(model="default")``) or an ``Engine``
    not yet started on another loop."""

    def __init__(self, engine=None, **engine_kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixd-lang-engine", daemon=True)
        self._thread.start()
        if engine is None:
            from radixd import Engine

            engine = self._call(_make_engine(Engine, engine_kwargs))
        self.engine = engine

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def generate(self, text: str, params: dict, on_text: Callable[[str], None]) -> dict:
        from radixd.core.errors import InvalidRequest

        async def run() -> dict:
            meta: dict = {}
            async for out in self.engine.generate(text, params=params):
                if out.text:
                    on_text(out.text)
                meta = {"finish_reason": out.finish_object(), "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens}
            return meta

        try:
            return self._call(run())
        except (InvalidRequest, TypeError) as exc:
            raise BackendError(str(exc), 400) from exc

    def select(self, text: str, choices: list[str]) -> list[Choice]:
        inputs = choice_inputs(self.tokenize, text, choices)

        async def score(ids: list[int], start: int) -> list[float]:
            params = {"max_new_tokens": 1, "temperature": 0.0, "prompt_logprobs_from": start}
            got: list[float] = []
            async for out in self.engine.generate(input_ids=ids, params=params):
                if out.prompt_logprobs is not None:
                    got = out.prompt_logprobs
            return got

        async def run() -> list[list[float]]:  # submitted together: one batch
            return await asyncio.gather(*(score(ids, s) for ids, s in inputs))

        lps = self._call(run())
        return [Choice(c, sum(lp), len(lp)) for c, lp in zip(choices, lps, strict=True)]


async def _make_engine(cls, kwargs):
    return cls(**kwargs)
