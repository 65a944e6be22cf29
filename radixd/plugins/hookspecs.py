"""Hook specifications of radixd.

Each hook is documented with its arguments. Factory hooks return objects that the engine
calls directly on its hot paths; lifecycle hooks are called once per event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixd.plugins.markers import hookspec

if TYPE_CHECKING:
    from radixd.core.policy import SchedulePolicy
    from radixd.core.tiers import CacheTier


# ---------------------------------------------------------------------------------------------
# Scheduling
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_schedule_policies() -> dict[str, type[SchedulePolicy]]:
    """Return the scheduling policies this plugin provides, by name.

    A policy class is instantiated once per engine with the engine's ``EngineConfig`` and
    must implement :class:`radixd.core.policy.SchedulePolicy`. Names must be unique across
    plugins; the engine refuses a duplicate name at start-up.
    """


@hookspec
def radixd_cache_tiers() -> dict[str, type[CacheTier]]:
    """Return the KV cache tiers this plugin provides, by name.

    A tier class implements :class:`radixd.core.tiers.CacheTier` (store, contains, load,
    evict, close, stats) and is instantiated once per engine, for each name listed in
    ``cache.tiers``, as ``cls(options, ctx)``: ``options`` is its ``[cache.NAME]`` table
    (refuse unknown keys with ``ConfigError``), ``ctx`` a ``TierContext`` (model identity,
    page shape, dtype, device). Failures of the store are misses, never exceptions. Names
    must be unique across plugins.
    """


# ---------------------------------------------------------------------------------------------
# Structured generation
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_grammar_backends() -> dict[str, type]:
    """Return the grammar backends this plugin provides, by name.

    A backend class is instantiated once per engine as ``cls(config, tokenizer=...,
    vocab_size=..., eos_ids=...)`` (``config``: the ``EngineConfig``; ``tokenizer``: the Hugging
    Face tokenizer; ``vocab_size``: the logits' width; ``eos_ids``: the model's EOS ids) and
    must follow the contract in :mod:`radixd.grammars`: ``compile(kind, spec)`` for kind
    ``regex``/``json_schema``/``ebnf``/``structural_tag`` returns a compiled grammar whose
    ``matcher()`` has ``accept_token``, ``fill_mask`` and ``is_terminated``; unsupported input
    (a kind it lacks included) raises ``radixd.grammars.GrammarError``. ``grammar_after`` needs
    nothing of a backend (the grammar service wraps its grammars). ``grammar.backend`` in
    radixd.toml picks one by name.
    """


# ---------------------------------------------------------------------------------------------
# Chat output
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_reasoning_parsers() -> dict[str, type]:
    """Return the reasoning parsers this plugin provides, by name.

    A parser class describes one model family's thinking markup (the contract is in
    :mod:`radixd.plugins.reasoning`): ``start`` and ``end`` markers, ``implicit_ends``,
    ``thinks(template_kwargs) -> bool`` (the output of a request with these
    ``chat_template_kwargs`` starts inside the reasoning, where the template's assistant turn
    writes no marker) and the classmethod ``detect(chat_template, generation_prompt) -> bool``
    (``reasoning_parser = "auto"`` picks it for this template). The server instantiates the chosen class once as ``cls()``; chat replies then
    carry the text between the markers as ``reasoning_content``. ``[model] reasoning_parser``
    names one; names must be unique across plugins.
    """


@hookspec
def radixd_tool_parsers() -> dict[str, type]:
    """Return the tool-call parsers this plugin provides, by name.

    A parser class subclasses :class:`radixd.server.tool_parsing.ToolParser`: ``markers`` (text
    of a chat template that picks it under ``model.tool_parser = "auto"``), ``form`` (the
    literal text around each call's arguments, from which tool grammars and the prompt for
    templates without tools are built) and ``run`` (the reader of its markup, on
    ``CallStream``'s primitives). The server makes one instance as ``cls(template)``
    (``template``: the model's chat template text). ``model.tool_parser`` in radixd.toml picks
    one by name. Names must be unique across plugins.
    """


# ---------------------------------------------------------------------------------------------
# Daemon lifecycle (called once; may return an awaitable, which the daemon awaits)
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_startup(state) -> None:
    """The model is loaded and the server is about to accept connections.

    ``state`` is the daemon's ``radixd.server.state.ServerState`` (engine, settings, metrics).
    """


@hookspec
def radixd_shutdown(state) -> None:
    """The daemon has drained and is about to exit; ``state`` as in ``radixd_startup``."""


# ---------------------------------------------------------------------------------------------
# Requests and steps (synchronous, cheap: called once per request or per batching step)
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_request_received(rid: str, route: str, prompt_tokens: int, params) -> None:
    """A generation request was admitted.

    ``rid``: the engine's request id; ``route``: the HTTP path; ``prompt_tokens``: prompt
    length after tokenization; ``params``: its ``radixd.core.sampling_params.SamplingParams``.
    """


@hookspec
def radixd_request_finished(rid: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                            finish_reasons: list) -> None:
    """A generation request ended (completed, stopped, aborted or disconnected).

    ``cached_tokens``: prompt tokens served from the radix cache; ``finish_reasons``: one per
    sample (``stop``, ``length``, ``abort``; None if the client left before the end).
    """


@hookspec
def radixd_step_stats(stats: dict) -> None:
    """One batching step ran. ``stats``: ``batch_size``, ``prefill_tokens``,
    ``decode_tokens``, ``running``, ``waiting``, ``kv_usage`` (0..1), ``step_ms``, ``idle_ms``
    (the replica's worker idle before the step), ``cycle_ms`` (since its launch before),
    ``replica``."""


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_routes(state) -> list:
    """Return extra starlette ``Route`` objects to mount on the server (``state`` as in
    ``radixd_startup``). Routes are subject to the same API keys and body limit."""


# ---------------------------------------------------------------------------------------------
# Prefill/decode disaggregation
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_kv_transfer_backends() -> dict[str, type]:
    """Return the KV transfer engines this plugin provides, by name.

    A backend class implements :class:`radixd.core.disagg.KVTransport` (``session_id``,
    ``register``, ``write``, ``close``) and is instantiated once per daemon in a prefill or
    decode role as ``cls(hostname, options)``: ``hostname`` the address peers reach this
    instance at, ``options`` the ``[disaggregation]`` keys it may read (``ib_device``).
    ``disaggregation.transfer_backend`` picks one by name (built in: ``mooncake``). Names
    must be unique across plugins.
    """


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_drafters() -> dict[str, type]:
    """Return the drafters (speculative decoding) this plugin provides, by name.

    A drafter class implements :class:`radixd.core.speculative.drafter.Drafter` and is
    instantiated once per replica as ``cls(config, cache)`` (``config``: the ``EngineConfig``;
    ``cache``: the replica's ``RadixCache``, to read only);
    ``propose(reqs, ks)`` returns, per request, at most ``ks[i]`` tokens guessed to follow
    ``reqs[i].seq``, called on the event loop once per step (the target model verifies every
    guess, so a drafter changes speed, never output). ``speculative.algorithm`` in radixd.toml
    picks one by name; names must be unique across plugins. A drafter class that also declares
    :class:`radixd.core.speculative.drafter.ReadsTarget` is fed the model's hidden states
    after each step (the built-in ``eagle3``).
    """
