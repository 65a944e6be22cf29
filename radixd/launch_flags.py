"""SGLang's launch flags (``python -m sglang.launch_server``) as ``radixd.toml`` keys.

Each flag is declared once in ``FLAGS``: its SGLang name, the key it sets, and how SGLang's
value becomes the key's (``convert``; a value radixd has no counterpart for is refused by
name). ``add_to`` puts the flags on a parser; ``overrides`` turns the parsed flags into
``{"section.key": value}``, which ``radixd.settings.load_settings`` lays over the file (flags
win). Each flag's value is checked as its key's is, and an error names the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixd.core.errors import ConfigError

# SGLang's --schedule-policy values without a radixd counterpart. fcfs and lpm map as is;
# any other name is a policy a plugin may provide (SGLang's priority: the radixd-priority
# plugin's, larger values first as in SGLang).
SGLANG_ONLY_POLICIES = ("random", "dfs-weight", "lof", "routing-key")


METAVARS = {"--mem-fraction-static": "FRACTION", "--chunked-prefill-size": "TOKENS",
            "--max-running-requests": "N", "--context-length": "TOKENS", "--reasoning-parser": "NAME",
            "--speculative-algorithm": "NAME", "--speculative-num-draft-tokens": "N", "--speculative-num-steps": "N",
            "--speculative-draft-model-path": "PATH",
            "--speculative-ngram-min-match-window-size": "TOKENS",
            "--speculative-ngram-max-match-window-size": "TOKENS", "--kv-events-config": "JSON"}

# SGLang's --speculative-algorithm values that need draft heads radixd lacks (EAGLE-1/2 heads,
# DeepSeek's multi-token-prediction layers); EAGLE3 maps to the built-in "eagle3".
SGLANG_ONLY_DRAFTERS = ("eagle", "nextn")


# SGLang's (and vLLM's) KVEventsConfig fields radixd has no counterpart for, at the values
# that ask for nothing: the replay socket, its buffer, the publisher's queue bound.
KV_EVENTS_DEFAULTS = {"replay_endpoint": None, "buffer_steps": 10_000, "max_queue_size": 100_000}


@dataclass(frozen=True)
class Flag:
    name: str                  # SGLang's spelling, e.g. "--tp-size"
    key: str                   # the radixd.toml key it sets (a section: ``convert`` sets several of its keys)
    type: Callable[[str], Any] | None  # None: a switch (store_true)
    help: str
    convert: Callable[[Any], Any] | None = None  # SGLang's value -> the key's; None: as is
    aliases: tuple[str, ...] = ()  # SGLang's other spellings of the flag
    sets: tuple[str, ...] = ()     # a section's flag: the keys ``convert``'s dict may set

    @property
    def metavar(self) -> str:
        return METAVARS.get(self.name) or self.name.rsplit("-", 1)[1].upper()

    @property
    def dest(self) -> str:
        return "flag_" + self.name.removeprefix("--").replace("-", "_")


def _policy(value: str) -> str:
    if value in SGLANG_ONLY_POLICIES:
        raise ConfigError("--schedule-policy", value, "fcfs, lpm or a plugin's policy; SGLang's "
                          f"{', '.join(SGLANG_ONLY_POLICIES)} have no radixd counterpart")
    return value


def _chunked_prefill(value: int) -> int:
    if value <= 0:  # SGLang: -1 turns chunking off
        raise ConfigError("--chunked-prefill-size", value, "a chunk size >= 1 (radixd always "
                          "chunks long prefills; a size of the context length chunks nothing)")
    return value


def _quantization(value: str) -> str:
    # SGLang's *_marlin names pick a kernel for the same checkpoint format
    return {"gptq_marlin": "gptq", "awq_marlin": "awq"}.get(value, value)


def _kv_events_config(value: str) -> dict[str, Any]:
    """SGLang's ``--kv-events-config`` JSON (vLLM's, with ``enable_kv_cache_events``, too) as
    ``kv_events.*`` keys. Publishing is on unless ``publisher`` is "null" or vLLM's switch is false."""
    import json

    try:
        cfg = json.loads(value)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict):
        raise ConfigError("--kv-events-config", value, "a JSON object of KVEventsConfig fields")
    known = {"publisher", "endpoint", "topic", "hwm", "enable_kv_cache_events", *KV_EVENTS_DEFAULTS}
    for field, v in cfg.items():
        if field not in known:
            raise ConfigError(f"--kv-events-config {field}", v, f"one of {', '.join(sorted(known))}")
        if field in KV_EVENTS_DEFAULTS and v != KV_EVENTS_DEFAULTS[field]:
            raise ConfigError(f"--kv-events-config {field}", v,
                              f"{json.dumps(KV_EVENTS_DEFAULTS[field])} (radixd has no replay socket or event queue bound)")
        if field == "hwm" and v != 100_000:
            raise ConfigError("--kv-events-config hwm", v, "100000 (the publisher's high-water mark)")
    publisher = cfg.get("publisher")
    if publisher not in (None, "zmq", "null"):
        raise ConfigError("--kv-events-config publisher", publisher, '"zmq" or "null"')
    out: dict[str, Any] = {"kv_events.enabled": publisher != "null" and cfg.get("enable_kv_cache_events", True)
                           is not False}
    if "endpoint" in cfg:
        out["kv_events.endpoint"] = cfg["endpoint"]
    if "topic" in cfg:
        out["kv_events.topic"] = cfg["topic"]
    return out


def _drafter(value: str) -> str:
    name = value.lower()  # SGLang spells them in capitals: NGRAM
    if name in SGLANG_ONLY_DRAFTERS:
        raise ConfigError("--speculative-algorithm", value, "NGRAM, STANDALONE, EAGLE3 or a plugin's drafter; "
                          "SGLang's EAGLE and NEXTN have no radixd counterpart yet")
    return name


FLAGS: tuple[Flag, ...] = (
    Flag("--model-path", "model.path", str, "checkpoint directory, .gguf file or 'default'",
         aliases=("--model",)),
    Flag("--host", "server.host", str, "address to listen on"),
    Flag("--port", "server.port", int, "port to listen on"),
    Flag("--tp-size", "parallel.tp_size", int, "tensor-parallel shards", aliases=("--tensor-parallel-size",)),
    Flag("--dp-size", "parallel.dp_size", int, "data-parallel replicas", aliases=("--data-parallel-size",)),
    Flag("--mem-fraction-static", "memory.mem_fraction", float,
         "fraction of GPU memory for weights and KV pool"),
    Flag("--chunked-prefill-size", "scheduler.chunked_prefill_size", int,
         "prefill chunk in tokens", _chunked_prefill),
    Flag("--max-running-requests", "scheduler.max_running_requests", int, "most requests in a batch"),
    Flag("--schedule-policy", "scheduler.policy", str, "fcfs or lpm (or a plugin's policy)", _policy),
    Flag("--disable-radix-cache", "cache.radix", None, "no prefix reuse", lambda v: not v),
    Flag("--is-embedding", "model.task", None, "serve an embedding model (/v1/embeddings)", lambda v: "embed"),
    Flag("--log-level", "logging.level", str, "debug, info, warning or error", str.lower),
    Flag("--api-key", "auth.api_keys", str, "the one API key clients must send", lambda v: [v]),
    Flag("--served-model-name", "model.served_name", str, "the model name the API reports"),
    Flag("--context-length", "model.max_context_len", int, "context length (at most the model's)"),
    Flag("--reasoning-parser", "model.reasoning_parser", str, "qwen3, qwen3-thinking, deepseek-r1 or a plugin's "
         "(radixd also takes auto and none)"),
    Flag("--kv-cache-dtype", "memory.kv_cache_dtype", str, "what the KV pool stores: auto, bfloat16, float16, fp8_e4m3 or fp8_e5m2"),
    Flag("--disaggregation-mode", "disaggregation.mode", str, "null (colocated), prefill or decode",
         lambda v: "off" if v == "null" else v),
    Flag("--disaggregation-bootstrap-port", "disaggregation.bootstrap_port", int,
         "the prefill role's bootstrap server port"),
    Flag("--disaggregation-transfer-backend", "disaggregation.transfer_backend", str,
         "KV transfer engine: mooncake or a plugin's"),
    Flag("--disaggregation-ib-device", "disaggregation.ib_device", str, "Mooncake's RDMA device (none: TCP)"),
    Flag("--quantization", "model.quantization", str, "the checkpoint's quantization format (compressed-tensors, "
         "fp8, gptq, awq; SGLang's gptq_marlin / awq_marlin name the same formats)", _quantization),
    Flag("--speculative-algorithm", "speculative.algorithm", str, "NGRAM (prompt lookup), STANDALONE (a draft "
         "model), EAGLE3 (an EAGLE-3 draft head) or a plugin's drafter", _drafter),
    Flag("--speculative-draft-model-path", "speculative.draft_model_path", str,
         "STANDALONE: the draft checkpoint; EAGLE3: the head's"),
    Flag("--speculative-num-draft-tokens", "speculative.num_draft_tokens", int, "most tokens drafted per step"),
    Flag("--speculative-eagle-topk", "speculative.eagle_topk", int, "continuations per drafted node (token trees)"),
    Flag("--speculative-num-steps", "speculative.num_draft_tokens", int, "draft depth (SGLang's EAGLE steps; with "
         "--speculative-num-draft-tokens, that must be steps x topk + 1: every node radixd verifies)"),
    Flag("--speculative-ngram-min-match-window-size", "speculative.ngram_min_match_window", int,
         "shortest suffix NGRAM looks up"),
    Flag("--speculative-ngram-max-match-window-size", "speculative.ngram_max_match_window", int,
         "longest suffix NGRAM looks up"),
    Flag("--kv-events-config", "kv_events", str, 'KV-cache events over ZMQ, as JSON: {"publisher": "zmq", '
         '"endpoint": ..., "topic": ...}', _kv_events_config,
         sets=("kv_events.enabled", "kv_events.endpoint", "kv_events.topic")),
)


def add_to(parser: argparse.ArgumentParser, *, subcommand: bool = False) -> None:
    """The flags on ``parser``. On a subcommand's parser they default to nothing at all, so
    that flags given before the subcommand's name are kept (argparse would otherwise let the
    subcommand's defaults overwrite them)."""
    group = parser.add_argument_group("SGLang launch flags (each sets a radixd.toml key; flags win over the file)")
    default = argparse.SUPPRESS if subcommand else None
    for f in FLAGS:
        help_text = f"{f.help} ({f.key})"
        if f.type is None:
            group.add_argument(f.name, *f.aliases, dest=f.dest, action="store_true", default=default, help=help_text)
        else:
            group.add_argument(f.name, *f.aliases, dest=f.dest, type=f.type, default=default, metavar=f.metavar,
                               help=help_text)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``{"section.key": value}`` of the flags given, each checked as its key."""
    from radixd.settings import check_key

    out: dict[str, Any] = {}
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        converted = f.convert(value) if f.convert else value
        for key, v in (converted.items() if isinstance(converted, dict) else [(f.key, converted)]):
            try:
                check_key(key, v)
            except ConfigError as exc:
                raise ConfigError(f"{f.name} ({key})", v, exc.allowed) from exc
            out[key] = v
    steps = getattr(args, "flag_speculative_num_steps", None)
    tokens = getattr(args, "flag_speculative_num_draft_tokens", None)
    if steps is not None and tokens is not None:  # (SGLang's EAGLE: the depth, and the nodes verified)
        topk = getattr(args, "flag_speculative_eagle_topk", None) or 1
        if tokens != steps * topk + 1:
            raise ConfigError("--speculative-num-draft-tokens", tokens,
                              f"{steps * topk + 1} with --speculative-num-steps {steps} and --speculative-eagle-topk "
                              f"{topk} (radixd verifies every node of a tree that deep and wide, and its root), "
                              "or no --speculative-num-steps (then it is the depth)")
        out["speculative.num_draft_tokens"] = steps
    return out


def flag_of(key: str) -> str | None:
    """The flag that sets ``key``, if one does."""
    return next((f.name for f in FLAGS if key == f.key or key in f.sets), None)
