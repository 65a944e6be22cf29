"""The drafter interface: what proposes the tokens a verify step checks.

Contract
--------
* A drafter class comes from the ``radixd_drafters`` hook, named by ``speculative.algorithm``;
  each replica makes one (``cls(config, cache)``: the ``EngineConfig`` and the replica's
  ``RadixCache``, which a drafter only reads, through ``peek_prefix_len`` and
  ``continuation``) and calls it on the event-loop thread, once per step, with the requests
  that draft this step (their tokens all known on the host: drafting steps are synchronous).
* ``propose`` only reads the requests (``Request.seq``, ``params``); it returns, per request,
  at most ``ks[i]`` token ids guessed to follow its sequence (fewer, or none, when it has no
  guess). A guess is a point proposal: the verify step accepts it with the target's
  probability of that token (see ``radixd.core.speculative``), so no drafter can change what
  is generated, only how fast.
* Instead of a list, a drafter may return a ``TokenTree`` (``radixd.core.speculative.tree``):
  several guesses sharing their first tokens, at most ``ks[i]`` deep, verified together (a
  drafter that branches reads ``speculative_eagle_topk``, the most children of a node).
* ``ReadsTarget`` is the declared capability of a drafter class that drafts from the target
  model's hidden states (EAGLE-3, ``eagle3``). Before the workers are built the engine asks
  the class for the ``target_layers`` it reads; every step of the replica's worker then also
  computes the residual stream after those layers at each token (nothing of the kind without
  such a drafter). The replica hands the drafter its worker (``attach``) once; after each
  step is processed (its picks in place, a verify entry cut to what it accepted) the
  scheduler hands it the streams of the positions that count (``features``), in order, and
  the requests that left the running set (``release``: finished, aborted or preempted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from radixd.core.config import EngineConfig
    from radixd.core.models.config import ModelConfig
    from radixd.core.request import Request
    from radixd.core.worker import Worker


class Drafter(Protocol):
    name: str

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:  # (or TokenTree)
        """Per request, up to ``ks[i]`` guessed next tokens (see the contract)."""
        ...


class Span(NamedTuple):
    """Positions ``start .. start + count - 1`` of a request's sequence, whose streams are
    ``count`` consecutive rows of a step's ``aux`` (each computed with the tokens the
    sequence holds before it)."""

    req: Request
    start: int
    count: int


@runtime_checkable
class ReadsTarget(Protocol):
    """The optional capability of a drafter class: it reads the target's hidden states (see
    the contract). Decided once, on the class, by the engine."""

    @classmethod
    def target_layers(cls, config: EngineConfig, target: ModelConfig) -> tuple[int, ...]:
        """The target layers (ascending, 0-based) after which it reads the residual stream,
        checked against the target's shape (a ``ConfigError`` naming what does not fit)."""
        ...

    def attach(self, target: Worker) -> None:
        """The replica's worker (its model and device), once, before the first step."""
        ...

    def features(self, spans: list[Span], aux: torch.Tensor) -> None:
        """After a step: ``aux`` [rows, len(target_layers) * hidden] on the worker's device,
        the spans' rows back to back in order (each span's request has the step's picks in
        ``output_ids`` already)."""
        ...

    def release(self, reqs: list[Request]) -> None:
        """These requests left the running set: drop what the drafter keeps for them."""
        ...


def to_device(t: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """``t`` (int64 where a list) on ``device`` without the host waiting for the device: on
    CUDA through page-locked memory (whose cached block is not reused before the copy is
    done), since a copy from pageable memory waits for the step in flight (overlap
    scheduling: ``radixd.core.staging``)."""
    if not isinstance(t, torch.Tensor):
        t = torch.tensor(t, dtype=torch.int64)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def reads_target(drafter: object) -> bool:
    """Whether ``drafter`` (a drafter class, or a factory) declares ``ReadsTarget``."""
    return isinstance(drafter, type) and issubclass(drafter, ReadsTarget)
