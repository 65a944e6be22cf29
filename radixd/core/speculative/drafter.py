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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixd.core.request import Request


class Drafter(Protocol):
    name: str

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:  # (or TokenTree)
        """Per request, up to ``ks[i]`` guessed next tokens (see the contract)."""
        ...
