"""SGLang's native ``/generate`` body, read into radixd's calls.

The field tables are ``protocol``'s (``NATIVE_SCHEMAS``, ``NATIVE_PARAM_SCHEMAS`` and the
no-op tables); this module reads a body by them: the prompts (``text`` / ``input_ids``, a list
is a batch), one ``SamplingParams`` per prompt (null meaning the default), the request ids,
and SGLang's logprob fields (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``return_text_in_logprobs``) mapped onto the engine's output logprobs and
``prompt_logprobs_from``. A field SGLang has and radixd does not act on is accepted only at
the value that asks for nothing; any other value is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.server.errors import ApiError
from radixd.server.protocol import (
    NATIVE_FIELDS,
    NATIVE_NOOPS,
    NATIVE_PARAM_NOOPS,
    NATIVE_PARAM_SCHEMAS,
    check_fields,
)


@dataclass
class LogprobAsk:
    """What one prompt's ``return_logprob`` asks for."""

    start: int                  # the first prompt position whose logprob is returned
    top: int                    # top logprobs per output position
    drop_output: bool           # ``max_new_tokens`` 0: one token is computed for the prompt's, not returned


@dataclass
class NativeRequest:
    prompts: list[str | list[int]]
    params: list[SamplingParams]     # one per prompt
    rids: list[str | None]           # one per prompt (None: the server picks)
    logprobs: list[LogprobAsk | None]
    text_in_logprobs: bool
    batch: bool                      # a list of prompts: answered with a list, never streamed
    stream: bool
    priority: int


def check_noop(where: str, key: str, value: Any, default: Any) -> None:
    """``value`` must ask for nothing: null, ``default``, or an empty list/object."""
    if value is None or value == [] or value == {} or (type(value) is type(default) and value == default):
        return
    shown = "null" if default is None else repr(default).lower() if isinstance(default, bool) else repr(default)
    raise ApiError(400, f"'{where}{key}' is not supported by this server (only {shown} is accepted)",
                   param=where + key, code="unsupported_parameter")


def sampling_dict(sp: Any) -> dict[str, Any]:
    """``sampling_params`` as ``SamplingParams`` keywords: nulls dropped, no-ops checked."""
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise ApiError(400, "'sampling_params' must be an object", param="sampling_params")
    kw: dict[str, Any] = {}
    for key, value in sp.items():
        if key in NATIVE_PARAM_NOOPS:
            check_noop("sampling_params.", key, value, NATIVE_PARAM_NOOPS[key])
        elif key not in NATIVE_PARAM_SCHEMAS:
            raise ApiError(400, f"unrecognized sampling parameter: '{key}'", param=f"sampling_params.{key}")
        elif value is not None:
            kw[key] = value
    return kw


def make_native_params(kw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidRequest as exc:
        raise ApiError(400, f"'sampling_params.{exc.field}': {exc.message}",
                       param=f"sampling_params.{exc.field}") from exc
    except TypeError as exc:  # a wrongly typed value reached the dataclass
        raise ApiError(400, str(exc), param="sampling_params") from exc


def _per_prompt(body: dict, key: str, n: int, kinds: tuple[type, ...], what: str) -> list[Any]:
    """``body[key]`` once for all prompts or a list of one per prompt (None when absent)."""
    value = body.get(key)
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ApiError(400, f"a list of '{key}' needs as many entries as prompts ({n})", param=key)
    for v in values:
        if v is not None and (not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)):
            raise ApiError(400, f"'{key}' must be {what} or a list of one per prompt", param=key)
    return values


def _prompts(body: dict) -> tuple[list[str | list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of 'text' or 'input_ids'", param="text")
    batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if text is not None:
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "'text' must be a string or a non-empty list of strings", param="text")
        return list(texts), batch
    lists = ids if batch else [ids]
    if not lists or not all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                            for x in lists):
        raise ApiError(400, "'input_ids' must be a list of integers or a non-empty list of such lists",
                       param="input_ids")
    return [list(x) for x in lists], batch


def parse_native(body: dict, tokenize: Callable[[str], list[int]]) -> NativeRequest:
    """``/generate``. ``tokenize``: the server's tokenizer; a text prompt that asks for
    logprobs is tokenized here, since its answer names each prompt token."""
    for key, default in NATIVE_NOOPS.items():
        if key in body:
            check_noop("", key, body[key], default)
    check_fields({k: v for k, v in body.items() if k not in NATIVE_NOOPS}, NATIVE_FIELDS)
    prompts, batch = _prompts(body)
    n = len(prompts)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if not batch or len(sp) != n:
            raise ApiError(400, "a list of 'sampling_params' needs a batch of as many prompts", param="sampling_params")
        kws = [sampling_dict(x) for x in sp]
    else:
        kws = [sampling_dict(sp)] * n
    want = _per_prompt(body, "return_logprob", n, (bool,), "a boolean")
    starts = _per_prompt(body, "logprob_start_len", n, (int,), "an integer")
    tops = _per_prompt(body, "top_logprobs_num", n, (int,), "an integer")
    if batch and isinstance(body.get("rid"), str):
        raise ApiError(400, "a batch needs a list of 'rid', one per prompt", param="rid")
    rids = _per_prompt(body, "rid", n, (str,), "a string")
    text_in = body.get("return_text_in_logprobs")
    if text_in is not None and not isinstance(text_in, bool):
        raise ApiError(400, "'return_text_in_logprobs' must be a boolean", param="return_text_in_logprobs")

    params: list[SamplingParams] = []
    asks: list[LogprobAsk | None] = []
    built: dict[int, SamplingParams] = {}  # prompts sharing one sampling_params share one object
    for i, kw in enumerate(kws):
        if not want[i]:
            if id(kw) not in built:
                built[id(kw)] = make_native_params(kw)
            params.append(built[id(kw)])
            asks.append(None)
            continue
        if isinstance(prompts[i], str):
            prompts[i] = tokenize(prompts[i])
        start = starts[i] if starts[i] is not None and starts[i] >= 0 else len(prompts[i]) - 1
        top = tops[i] or 0
        drop = kw.get("max_new_tokens") == 0
        params.append(make_native_params({**kw, "logprobs": True, "top_logprobs": top,
                                          "prompt_logprobs_from": start, "prompt_top_logprobs": top, **({"max_new_tokens": 1} if drop else {})}))
        asks.append(LogprobAsk(start=start, top=top, drop_output=drop))
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    if stream and batch:
        raise ApiError(400, "a batch of prompts cannot stream", param="stream")
    priority = body.get("priority") or 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ApiError(400, "'priority' must be an integer", param="priority")
    model = body.get("model")  # named by gateways (smg: "unknown" when the client names none); as
    if model is not None and not isinstance(model, str):  # SGLang's GenerateReqInput, read by no one
        raise ApiError(400, "'model' must be a string", param="model")
    return NativeRequest(prompts, params, rids, asks, bool(text_in), batch, stream, priority)
