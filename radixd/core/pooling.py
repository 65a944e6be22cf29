"""Embeddings: which checkpoints pool, how, and one request's pooled hidden states.

    checkpoint: modules.json + 1_Pooling/config.json (sentence-transformers) -> Pooling
    request:    prompt chunks -> worker sums the final hidden states (after the last norm,
                before the LM head) of the wanted positions -> PoolState.add -> embedding()

Contract
--------
* ``engine_pooling(task, path)`` decides once, at start-up, whether an engine embeds
  (a ``Pooling``) or generates (None). An embedding engine serves only embeddings, as vLLM's
  pooling runner and SGLang's ``--is-embedding`` do; a generation engine refuses them.
* An embedding request (``Request.pool``) runs its whole prompt and samples nothing; the
  batch builder lays out the positions it wants pooled (``PoolState.wanted``), the worker
  returns one summed row per request and step, the scheduler adds them here and finishes
  the request once its prompt is computed. Its KV then enters the radix cache like any
  finished prefill.
* The radix cache: a prefix match may only cover positions already pooled (hidden states
  are not cached, KV is). Last-token pooling wants only the last position, so any cached
  prefix is reused; mean pooling wants every position and first-token (cls) pooling the
  first, so such a request recomputes its prompt (its KV still goes into the cache for
  others). A preempted request keeps its sums and resumes past what it pooled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from radixd.core.errors import ConfigError

# sentence-transformers' Pooling config: its flags (and its newer ``pooling_mode`` string)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST = "sentence_transformers.models."
_ST_PASSIVE = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


@dataclass(frozen=True)
class Pooling:
    """How an embedding engine turns a prompt's final hidden states into one vector."""

    mode: str        # "last" (Qwen3-Embedding), "mean" or "cls" (the first token)
    normalize: bool  # L2-normalised (a Normalize module in modules.json)

    def span(self, prompt_len: int) -> tuple[int, int]:
        """The prompt positions [start, end) whose hidden states are pooled."""
        if self.mode == "last":
            return prompt_len - 1, prompt_len
        return 0, 1 if self.mode == "cls" else prompt_len


def read_pooling(path: Path) -> Pooling | None:
    """The sentence-transformers pooling of the checkpoint at ``path`` (None: it has no
    ``modules.json``); raises ``ConfigError`` for modules radixd cannot apply (``[model] task
    = "generate"`` serves such a checkpoint as a generation model, ignoring them)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    other = [t for t in types if t not in _ST_PASSIVE]
    if other:
        raise ConfigError("model.path", str(path), f"a checkpoint whose modules.json lists only Transformer, Pooling "
                          f"and Normalize modules (this one also has {other[0]})")
    pools = [m for m in modules if m.get("type") == _ST + "Pooling"]
    if len(pools) != 1:
        raise ConfigError("model.path", str(path), f"a checkpoint with one Pooling module in modules.json (this one "
                          f"has {len(pools)})")
    cfg = json.loads((path / pools[0].get("path", "1_Pooling") / "config.json").read_text())
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if not on and isinstance(cfg.get("pooling_mode"), str):
        on = [cfg["pooling_mode"]]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ConfigError("model.path", str(path), "a Pooling config with one of pooling_mode_lasttoken, "
                          f"pooling_mode_mean_tokens, pooling_mode_cls_token (this one asks for {', '.join(on) or 'none'})")
    if cfg.get("include_prompt", True) is not True:
        raise ConfigError("model.path", str(path), "a Pooling config that pools the whole prompt (this one sets "
                          "include_prompt = false)")
    return Pooling(_ST_MODES[on[0]], normalize=_ST + "Normalize" in types)


def engine_pooling(task: str, path: Path) -> Pooling | None:
    """The engine's pooling for ``[model] task`` (None: a generation engine). ``auto`` embeds
    when the checkpoint has sentence-transformers files; ``embed`` without them pools the last
    token, normalised (vLLM's default for decoder models)."""
    pooling = None if task == "generate" else read_pooling(path)
    if task == "embed" and pooling is None:
        return Pooling("last", normalize=True)
    return pooling


class PoolState:
    """One embedding request's pooling so far: the sum of the hidden states of its wanted
    positions [start, done); ``done`` advances as the steps that computed them are read."""

    __slots__ = ("pooling", "start", "end", "done", "total")

    def __init__(self, pooling: Pooling, prompt_len: int):
        self.pooling = pooling
        self.start, self.end = pooling.span(prompt_len)
        self.done = self.start
        self.total: torch.Tensor | None = None

    @property
    def missing(self) -> int | None:
        """The first wanted position not yet pooled (None: all are): where a cached prefix
        the request reuses must end."""
        return self.done if self.done < self.end else None

    def wanted(self, start: int, end: int) -> range:
        """The positions of a chunk [start, end) to pool (those pooled before a preemption
        are not pooled again)."""
        return range(max(start, self.done), min(end, self.end))

    def add(self, part: torch.Tensor, n: int) -> None:
        """``part``: the float32 sum of the next ``n`` wanted positions' hidden states."""
        self.total = part.clone() if self.total is None else self.total + part  # (not a view of the step's rows)
        self.done += n

    def embedding(self) -> list[float]:
        vec = self.total / (self.end - self.start)
        return normalized(vec).tolist() if self.pooling.normalize else vec.tolist()


def normalized(vec: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vec.double(), dim=-1).float()


def truncate(embedding: list[float], dimensions: int, normalize: bool) -> list[float]:
    """Matryoshka truncation: the first ``dimensions`` values, normalised again when the
    model normalises (vLLM's order: truncate, then normalise)."""
    vec = torch.tensor(embedding[:dimensions], dtype=torch.float32)
    return normalized(vec).tolist() if normalize else vec.tolist()


def accumulate(pool_reqs: list, pooled: torch.Tensor) -> None:
    """A step's pooled rows (``ScheduledStep.pool_reqs`` order) into their requests; a
    request whose prompt the step completed is finished."""
    for i, (r, n, last) in enumerate(pool_reqs):
        r.pool.add(pooled[i], n)
        if last:
            r.finish("stop")
