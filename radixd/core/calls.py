"""A call (one ``generate``/``submit``) checked against the model and made into requests.

``Calls.check`` refuses what the engine cannot serve before anything is queued (the prompt
against the tokenizer, vocabulary and context, ``n`` and ``top_logprobs`` against their
limits, the whole call against the KV pool; an embedding call, ``check_embed``, against the
context and pool), raising ``InvalidRequest`` or ``ContextLengthExceeded`` naming the field;
``Calls.requests`` makes the call's ``n`` requests with their deterministic seeds (an
embedding engine's requests pool their prompts, ``Request.pool``). Runs on the event loop's thread.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from radixd.core.config import EngineConfig
from radixd.core.errors import ContextLengthExceeded, InvalidRequest
from radixd.core.pooling import Pooling, PoolState
from radixd.core.request import Group, Request
from radixd.core.sampling_params import SamplingParams


class Calls:
    """``pool_slots``: the KV slots of one replica's pool (every replica's has this size)."""

    def __init__(self, config: EngineConfig, *, tokenizer, vocab_size: int, context_len: int, pool_slots: int,
                 pooling: Pooling | None = None):
        self.tokenizer = tokenizer  # None: token ids only
        self.pooling = pooling  # an embedding engine's: it takes embedding calls only
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.pool_slots = pool_slots
        self.max_n = config.max_n
        self.max_top_logprobs = config.max_top_logprobs
        self._rng = random.Random(config.seed)

    def check(self, prompt: str | None, input_ids: Sequence[int] | None, params: SamplingParams) -> list[int]:
        """The call's prompt token ids; raises ``InvalidRequest`` naming the field."""
        if self.pooling is not None:  # as vLLM's pooling runner and SGLang's --is-embedding
            raise InvalidRequest("model", "this is an embedding model ([model] task = \"embed\"): it computes "
                                          "embeddings (POST /v1/embeddings), not text")
        ids = self._prompt_ids(prompt, input_ids)
        if self.tokenizer is None and params.stop:
            raise InvalidRequest("stop", "stop strings need a tokenizer; this engine runs without one")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequest("logit_bias", f"token id {max(params.logit_bias)} is outside the model's "
                                               f"vocabulary of {self.vocab_size}")
        if params.n > self.max_n:
            raise InvalidRequest("n", f"must be <= {self.max_n}, got {params.n}")
        if params.top_logprobs > self.max_top_logprobs:
            raise InvalidRequest("top_logprobs", f"must be <= {self.max_top_logprobs}, got {params.top_logprobs}")
        if params.prompt_top_logprobs > self.max_top_logprobs:
            raise InvalidRequest("prompt_top_logprobs", f"must be <= {self.max_top_logprobs}, "
                                                        f"got {params.prompt_top_logprobs}")
        if len(ids) >= self.context_len:
            raise ContextLengthExceeded(
                "prompt", len(ids), self.context_len,
                f"the prompt has {len(ids)} tokens; the model's context is {self.context_len} tokens",
            )
        params = self.fitted(params, len(ids))
        if len(ids) + params.max_new_tokens > self.context_len:
            raise ContextLengthExceeded(
                "max_new_tokens", len(ids), self.context_len,
                f"the prompt ({len(ids)} tokens) plus {params.max_new_tokens} tokens to generate "
                f"exceed the model's context of {self.context_len} tokens",
            )
        need = len(ids) + params.n * params.max_new_tokens
        if need > self.pool_slots:
            field_name = "n" if params.n > 1 else "max_new_tokens"
            raise InvalidRequest(
                field_name,
                f"the request needs up to {need} KV slots (prompt {len(ids)} + n {params.n} x "
                f"max_new_tokens {params.max_new_tokens}); the KV pool holds {self.pool_slots}",
            )
        return ids

    def check_embed(self, prompt: str | None, input_ids: Sequence[int] | None) -> list[int]:
        """An embedding call's prompt token ids (all of the context may be used: nothing is
        generated); raises ``InvalidRequest`` naming the field."""
        if self.pooling is None:
            raise InvalidRequest("model", "this model generates text; it has no embeddings (an embedding checkpoint, "
                                          "or [model] task = \"embed\", serves them)")
        ids = self._prompt_ids(prompt, input_ids)
        if len(ids) > self.context_len:  # vLLM's wording
            raise ContextLengthExceeded(
                "prompt", len(ids), self.context_len,
                f"This model's maximum context length is {self.context_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of the input.")
        if len(ids) > self.pool_slots:
            raise InvalidRequest("prompt", f"the input needs {len(ids)} KV slots; the KV pool holds {self.pool_slots}")
        return ids

    def _prompt_ids(self, prompt: str | None, input_ids: Sequence[int] | None) -> list[int]:
        """The prompt (text, tokenized, or token ids) checked against the vocabulary."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("prompt", "give exactly one of prompt (text) or input_ids")
        if input_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequest("prompt", "must be a string")
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "this engine runs without a tokenizer: send input_ids")
            ids = self.tokenizer(prompt).input_ids
            if ids and max(ids) >= self.vocab_size:  # a tokenizer larger than the embedding
                raise InvalidRequest("prompt", f"the text tokenizes to token id {max(ids)}, outside the "
                                               f"model's vocabulary of {self.vocab_size}")
        else:
            ids = list(input_ids)
            vocab = self.vocab_size
            # plain ints (what JSON gives) checked at C speed: a long prompt's per-token Python
            # check cost as much as the rest of its admission
            if set(map(type, ids)) <= {int}:
                ok = not ids or (min(ids) >= 0 and max(ids) < vocab)
            else:
                ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
            if not ok:
                raise InvalidRequest("input_ids", f"token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        return ids

    def fitted(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """``params`` with ``max_new_tokens`` None resolved to what fits after the prompt in
        the context and, for each of the ``n`` samples, in the KV pool (at least 1, so that a
        prompt leaving no room is refused by the checks rather than answered empty)."""
        if params.max_new_tokens is not None:
            return params
        room = min(self.context_len - prompt_tokens, (self.pool_slots - prompt_tokens) // params.n)
        return dataclasses.replace(params, max_new_tokens=max(1, room))

    def requests(self, rid: str, ids: list[int], params: SamplingParams, *, namespace: int,
                 arrival: Callable[[], int]) -> list[Request]:
        """The call's ``params.n`` requests (one ``Group`` when n > 1), with their seeds:
        ``params.seed`` or a draw from the engine's seeded generator, then one per sample."""
        ns = namespace
        group = Group(size=params.n, namespace=ns, followers_waiting=params.n - 1) if params.n > 1 else None
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        reqs = []
        for i in range(params.n):
            seed = base_seed if i == 0 else (base_seed * 1_000_003 + i) % (1 << 62)
            reqs.append(
                Request(
                    rid=rid if params.n == 1 else f"{rid}-{i}",
                    prompt_ids=ids,
                    params=params,
                    seed=seed,
                    arrival=arrival(),
                    namespace=ns,
                    index=i,
                    group=group,
                    pool=None if self.pooling is None else PoolState(self.pooling, len(ids)),
                )
            )
        return reqs
