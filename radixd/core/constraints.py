"""Grammar constraints as core uses them: the matcher protocol, masks, and feeding tokens.

Contract
--------
* A constrained request carries one ``Matcher`` (``Request.matcher``; made by a grammar
  backend, one per sample). Core calls it from the event-loop thread only: ``fill_mask``
  before the token is sampled, ``accept_token`` with each sampled token, in order, then
  ``is_terminated``.
* ``ClosesWithin`` is the declared capability of matchers that can leave out the tokens
  after which the document could no longer close within the tokens left; with
  ``grammar_close_within_max_tokens`` on, their masks are filled through
  ``fill_mask_within``. Which matcher classes have it is decided once per class.
* ``Forks`` is the declared capability of matchers that can copy their position: speculative
  decoding walks a fork over a request's drafts (each draft masked by the fork's state
  before it) and drops it, so the matcher itself only ever sees accepted tokens and a
  rejected draft needs no rollback.
* A mask is filled only once every earlier token of the request reached its matcher: under
  overlap scheduling a step whose matchers still wait for the launched step's picks gets
  ``deferred_masks`` and an ``allowed_future`` that the engine resolves (``fill_masks``)
  while the forward runs.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from radixd.core.forward_batch import SamplingBatch

if TYPE_CHECKING:
    from radixd.core.request import Request


class Matcher(Protocol):
    def fill_mask(self, out: np.ndarray) -> None:
        """``out``: numpy bool [vocab]; set True exactly the tokens allowed next."""
        ...

    def accept_token(self, token: int) -> bool:
        """Advance by the sampled ``token`` (EOS included); False if it was not allowed."""
        ...

    def is_terminated(self) -> bool:
        """Nothing but EOS may follow: the request finishes now."""
        ...


@runtime_checkable
class ClosesWithin(Protocol):
    """The optional capability of a ``Matcher``: masks that keep the document closable."""

    def fill_mask_within(self, out: np.ndarray, tokens_left: int) -> None:
        """As ``fill_mask``, less the tokens after which the document cannot be completed
        within ``tokens_left - 1`` more."""
        ...


@runtime_checkable
class Forks(Protocol):
    """The optional capability of a ``Matcher``: an independent copy of its position."""

    def fork(self) -> Matcher | None:
        """A matcher at the same position whose tokens leave this one as it is; None where
        this one cannot be copied (e.g. it wraps a matcher that cannot)."""
        ...


class Constraints:
    """Masks for the constrained rows of a sampling batch, sized to the logits' width."""

    def __init__(self, *, vocab_size: int | None, context_len: int, close_within: bool):
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.close_within = close_within
        self._capable: dict[tuple[type, type], bool] = {}  # (matcher class, capability) -> has it

    def add_masks(self, sb: SamplingBatch, reqs: list[Request]) -> None:
        """Give ``sb`` the masks of its constrained rows, now or deferred (see the contract)."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.matcher is not None]
        if any(r.unresolved for _, r in rows):
            sb.deferred_masks = rows
            sb.allowed_future = concurrent.futures.Future()
        else:
            sb.allowed = torch.from_numpy(self.fill_masks(len(reqs), rows))

    def fill_masks(self, rows: int, constrained: list[tuple[int, Request]]) -> np.ndarray:
        """[rows, vocab] bool: each constrained row's grammar mask, the others all True (and
        so are rows of requests that finished meanwhile: their picks are dropped)."""
        allowed = np.ones((rows, self.vocab_size), dtype=bool)
        for i, r in constrained:
            if r.finish_reason is None:
                self.fill_row(r.matcher, allowed[i], self.tokens_left(r))
        return allowed

    def fill_row(self, m: Matcher, out: np.ndarray, tokens_left: int) -> None:
        """``m``'s mask into ``out``, with ``tokens_left`` tokens (this one included) to come."""
        if self.close_within and self.has(m, ClosesWithin):
            m.fill_mask_within(out, tokens_left)
        else:
            m.fill_mask(out)

    def has(self, m: Matcher, capability: type) -> bool:
        """Whether ``m`` has the optional ``capability`` (decided once per matcher class)."""
        key = (type(m), capability)
        got = self._capable.get(key)
        if got is None:
            got = self._capable[key] = isinstance(m, capability)
        return got

    def tokens_left(self, r: Request) -> int:
        """Tokens ``r`` may still generate, the one being sampled included (its matcher has
        accepted every earlier one: masks are filled once the tokens before are known)."""
        return min(r.params.max_new_tokens, self.context_len - len(r.prompt_ids)) - r.num_output


def feed(r: Request, tok: int) -> None:
    """Hand ``r``'s matcher its sampled token ``tok`` and finish ``r`` if the grammar says so."""
    if not r.matcher.accept_token(tok):  # the mask allowed it: a backend bug
        r.finish("abort")
    elif r.finish_reason in (None, "length") and r.matcher.is_terminated():
        r.finish("stop")  # the grammar is complete: nothing else may follow
