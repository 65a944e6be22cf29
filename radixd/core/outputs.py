"""Where a call's outputs are made: each sampled token becomes a ``GenerateOutput`` on the
call's queue, read by its ``Submission``.

    Replica step -> Outputs.emit (detokenize, stop strings, logprobs, stream_interval
    coalescing, slow-consumer abort) -> OutputQueue -> Submission.__anext__ -> caller

Contract: ``Outputs`` runs on the event loop's thread only. It owns the streams (one per
request) and the calls in flight (``by_rid``); the replicas tell it which requests ended
(``release``, ``drop``, ``fail``), the engine opens and forgets calls. It writes a request's
``finish_reason`` only through ``Request.finish`` (a stop string found in the text); every
other finish is the scheduler's. ``emit`` runs for every sampled token of every step: no
per-token work beyond what the output needs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from radixd.core.detokenizer import Detokenizers, TextStream
from radixd.core.forward_batch import StepOutput
from radixd.core.request import Request
from radixd.core.sampling_params import SamplingParams
from radixd.core.scheduler import ScheduledStep

log = logging.getLogger("radixd.engine")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerateOutput:
    """One streamed update of one of the ``n`` samples of a ``generate`` call."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With ``prompt_logprobs_from``: the prompt tokens' logprobs from that position on (in
    # the sample's first update only).
    prompt_logprobs: list[float] | None = None
    # With finish_reason "stop": what ended the sample: the token id (a stop token, EOS, the
    # last token of a completed grammar) or the stop string.
    matched: int | str | None = None
    # Beside ``prompt_logprobs``: each of those tokens' rank, and with prompt_top_logprobs the
    # position's top alternatives as (token id, logprob).
    prompt_ranks: list[int] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    embedding: list[float] | None = None  # an embedding call's one output: the pooled vector

    def finish_object(self) -> dict | None:
        """The finish reason as SGLang's native API reports it: ``{"type": "stop", "matched":
        token id or stop string}``, ``{"type": "length", "length": tokens}``, ``{"type":
        "abort", "message": ...}``; None before the end."""
        if not self.finished or self.finish_reason is None:
            return None
        if self.finish_reason == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.finish_reason == "length":
            return {"type": "length", "length": self.completion_tokens}
        return {"type": self.finish_reason, "message": "the request was aborted"}


class OutputQueue:
    """An unbounded FIFO of one call's outputs: ``asyncio.Queue``'s interface for what the
    engine uses (``put_nowait``, ``get``, ``get_nowait``, ``qsize``, ``empty``) at less cost
    per item, since the loop puts one item per running request per step."""

    __slots__ = ("_items", "_getters")

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._getters: collections.deque[asyncio.Future] = collections.deque()

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self._getters:
            self._wake_next()

    async def get(self):
        items = self._items
        while not items:
            g = asyncio.get_running_loop().create_future()
            self._getters.append(g)
            try:
                await g
            except BaseException:
                g.cancel()  # if not done yet
                with contextlib.suppress(ValueError):
                    self._getters.remove(g)
                if items and not g.cancelled():  # woken, then cancelled: pass the wake-up on
                    self._wake_next()
                raise
        return items.popleft()

    def _wake_next(self) -> None:
        getters = self._getters
        while getters:
            g = getters.popleft()
            if not g.done():
                g.set_result(None)
                return

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


class Submission:
    """The outputs of one ``Engine.submit`` call, as an async iterator.

    ``close()`` (or leaving ``generate``'s loop) aborts whatever has not finished.
    """

    def __init__(self, outputs: Outputs, rid: str, reqs: list[Request], queue: OutputQueue, n: int,
                 prompt_tokens: int):
        self.rid = rid
        self.reqs = reqs
        self.prompt_tokens = prompt_tokens
        self.n = n
        self._outputs = outputs
        self._queue = queue
        self._left = n
        self.replica = 0  # which data-parallel replica serves it

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._left == 0:
            self.close()
            raise StopAsyncIteration
        q = self._queue
        item = q.get_nowait() if q.qsize() else await q.get()
        if isinstance(item, BaseException):
            self._left = 0
            self.close()
            raise item
        if item.finished:
            self._left -= 1
        return item

    def ready(self) -> bool:
        """Whether ``__anext__`` returns without waiting (an output or the end is there)."""
        return self._left == 0 or self._queue.qsize() > 0

    def close(self) -> None:
        """Abort unfinished samples and forget the call (idempotent)."""
        self._outputs.forget(self.rid, self.reqs, abort=self._left > 0)


@dataclass
class _Stream:
    queue: OutputQueue
    detok: TextStream | None
    prompt_lp_sent: bool = False
    rid: str = ""
    limit: int = 0  # outputs left unread before the call is aborted; 0: unbounded
    held: GenerateOutput | None = None  # tokens not yet sent (stream_interval > 1)

    def flush(self) -> None:
        if self.held is not None:
            self.queue.put_nowait(self.held)
            self.held = None


class Outputs:
    """The streams of every request in flight, over all replicas (see the module docstring).

    ``abort(rid)``: the engine's abort of a whole call (a consumer that stopped reading)."""

    def __init__(self, *, tokenizer, eos_token_ids: tuple[int, ...], stream_interval: int,
                 abort: Callable[[str], bool]):
        self.detokenizers = None if tokenizer is None else Detokenizers(tokenizer)  # None: ids only, no text
        self.eos = eos_token_ids
        self.interval = stream_interval
        self._abort = abort
        self.streams: dict[Request, _Stream] = {}
        self.by_rid: dict[str, list[Request]] = {}  # the calls in flight
        self.slow_consumer_aborts = 0  # calls aborted because their outputs were not read

    # ------------------------------------------------------------------ calls

    def open(self, rid: str, reqs: list[Request], params: SamplingParams, prompt_ids: list[int],
             max_unread: int) -> Submission:
        """A stream per request of a new call; the call's ``Submission``."""
        queue = OutputQueue()
        for r in reqs:
            detok = None
            if self.detokenizers is not None and r.pool is None:
                detok = self.detokenizers.new(prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                              stop=params.stop, keep_stop=params.include_stop_str_in_output)
            self.streams[r] = _Stream(queue, detok, rid=rid, limit=max_unread * len(reqs))
        self.by_rid[rid] = reqs
        return Submission(self, rid, reqs, queue, len(reqs), len(prompt_ids))

    def empty(self, rid: str, n: int, prompt_tokens: int) -> Submission:
        """A call with nothing to generate (``max_new_tokens`` = 0): ``n`` finished outputs."""
        queue = OutputQueue()
        for i in range(n):
            queue.put_nowait(GenerateOutput(i, [], "", True, "length", prompt_tokens=prompt_tokens))
        return Submission(self, rid, [], queue, n, prompt_tokens)

    def forget(self, rid: str, reqs: list[Request], *, abort: bool) -> None:
        """The consumer is done with the call (``abort``: before its end)."""
        if self.by_rid.get(rid) is reqs:
            if abort:
                self._abort(rid)
            del self.by_rid[rid]

    # ------------------------------------------------------------------ requests ending

    def release(self, reqs: Iterable[Request]) -> None:
        """Finished requests whose last output was emitted."""
        for r in reqs:
            self.streams.pop(r, None)

    def drop(self, reqs: Iterable[Request]) -> None:
        """Requests the scheduler dropped (aborts): tell their consumers that they ended."""
        for r in reqs:
            stream = self.streams.pop(r, None)
            if stream is not None:
                stream.flush()
                stream.queue.put_nowait(
                    GenerateOutput(r.index, [], "", True, r.finish_reason, prompt_tokens=len(r.prompt_ids),
                                   completion_tokens=r.num_output, cached_tokens=r.cached_tokens or 0)
                )

    def fail(self, reqs: Iterable[Request], message: str) -> None:
        """End the requests' streams with ``RuntimeError(message)``."""
        for r in reqs:
            stream = self.streams.pop(r, None)
            if stream is not None:
                stream.queue.put_nowait(RuntimeError(message))

    # ------------------------------------------------------------------ tokens

    def emit(self, step: ScheduledStep, out: StepOutput, accepted: list[int]) -> None:
        """Stream the accepted picks of ``step`` (indices into ``step.sampled``), and the
        embeddings of the embedding requests it finished."""
        streams = self.streams
        for r, _, last in step.pool_reqs:
            if last and r.finish_reason == "stop" and (stream := streams.get(r)) is not None:
                stream.queue.put_nowait(GenerateOutput(r.index, [], "", True, "stop", prompt_tokens=len(r.prompt_ids),
                                                       cached_tokens=r.cached_tokens or 0,
                                                       embedding=r.pool.embedding()))
        interval = self.interval
        eos = self.eos
        sampled = step.sampled
        next_tokens = out.next_tokens
        out_logprobs = out.logprobs
        for i in accepted:
            r = sampled[i]
            stream = streams.get(r)
            if stream is None:
                continue
            tok = next_tokens[i]
            detok = stream.detok
            if detok is not None and detok.stopped:
                continue  # a stop string ended it at an earlier pick of this step (speculation)
            p = r.params
            count = step.pick_index[i] + 1  # the request's tokens with this one
            reason = r.finish_reason
            if reason is not None and count < r.num_output:
                reason = None  # a later pick of this step is its last (speculation)
            stop_token = reason == "stop" and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos))
            matched = tok if reason == "stop" else None  # a stop token / EOS, or a grammar's last
            if detok is None or stop_token:
                text = ""  # no tokenizer, or a stop token id / EOS: no text
            else:
                text = detok.add(tok)
                if detok.stopped:  # a stop string, even on the last allowed token
                    r.finish("stop")
                    reason = r.finish_reason
                    matched = detok.matched
                    # accepted drafts past it are not generated (placeholders of a step in
                    # flight stay: that step drops them)
                    del r.output_ids[count : len(r.output_ids) - r.unresolved]
            finished = reason is not None
            if finished and detok is not None and not detok.stopped:
                text += detok.finish()
            lp = None
            if p.logprobs and out_logprobs is not None:
                top = out.top_logprobs[i][: p.top_logprobs] if out.top_logprobs else []
                lp = [TokenLogprob(tok, out_logprobs[i], top)]
            plp = ranks = ptop = None
            if p.prompt_logprobs_from is not None and not stream.prompt_lp_sent:
                plp, ranks = list(r.prompt_logprobs), list(r.prompt_ranks)
                ptop = list(r.prompt_top) if p.prompt_top_logprobs else None
                stream.prompt_lp_sent = True
            queue = stream.queue
            update = GenerateOutput(r.index, [tok], text, finished, reason, lp, len(r.prompt_ids),
                                    count, r.cached_tokens or 0, plp, matched, ranks, ptop)
            if interval > 1:  # coalesce: send every ``interval`` tokens, and at the end
                held = stream.held
                if held is not None:
                    held.token_ids.append(tok)
                    held.text += text
                    held.finished, held.finish_reason, held.matched = finished, reason, matched
                    held.completion_tokens = update.completion_tokens
                    if lp is not None:
                        held.logprobs = (held.logprobs or []) + lp
                    update = held
                    stream.held = None
                if not finished and len(update.token_ids) < interval:
                    stream.held = update
                    continue
            queue.put_nowait(update)
            if stream.limit and queue.qsize() > stream.limit and not finished and not r.aborted:
                log.warning("outputs of %s are not being read (%d waiting): aborting it", stream.rid,
                            queue.qsize())
                self.slow_consumer_aborts += 1
                self._abort(stream.rid)
