"""A request's state as the scheduler sees it.

Life cycle: WAITING -> RUNNING (has a table row and KV) -> FINISHED; preemption sends a
RUNNING request back to WAITING with its generated tokens kept and its KV given back.

KV ownership of a running request (``kv_len`` tokens have KV in the pool)::

    slots[0:cached_len]        owned by the radix tree, pinned by the lock on last_node
    slots[cached_len:kv_len]   private to this request (freed or inserted on release)

Decode steps append one slot each: ``append_slot`` keeps those as Python ints and ``slots``
folds them into the tensor only when read (release, cache insertion, accounting checks), so
a decode step costs no tensor operation per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from radixd.core.radix_cache import TreeNode
from radixd.core.sampling_params import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Group:
    """The ``n`` samples of one call: followers wait until the leader's prompt is cached."""

    size: int
    namespace: int
    prompt_node: TreeNode | None = None   # locked on the group's behalf until all have it
    followers_waiting: int = 0            # followers not yet admitted
    leader_gone: bool = False             # leader aborted before caching the prompt


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    namespace: int = 0
    priority: int = 0                     # larger is more urgent; policies may use it
    index: int = 0                        # which of the n samples
    group: Group | None = None
    state: State = State.WAITING
    output_ids: list[int] = field(default_factory=list)
    unresolved: int = 0                   # trailing output ids still on the device (placeholders)
    row: int | None = None
    _slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64), repr=False)
    _slot_tail: list[int] = field(default_factory=list, repr=False)  # appended, not yet in _slots
    kv_len: int = 0
    cached_len: int = 0
    last_node: TreeNode | None = None
    # cascade.chain of slots[:cached_len], kept by the scheduler; dropped whenever ``slots`` is
    # replaced (appended decode slots lie past cached_len and leave it valid)
    share_chain: list[int] | None = None
    table_writes: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (start, slots) for the table row
    finish_reason: str | None = None
    aborted: bool = False
    cached_tokens: int | None = None      # prompt tokens served from the cache (first admission)
    preemptions: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)  # from prompt_lp_start on
    matcher: object | None = None         # grammar matcher (radixd.grammars) if constrained
    sampling_row: tuple | None = None     # constant sampling inputs, filled by the scheduler

    @property
    def slots(self) -> torch.Tensor:
        """int64 KV slots of the request's tokens, in order (see the module docstring)."""
        if self._slot_tail:
            self._slots = torch.cat((self._slots, torch.tensor(self._slot_tail, dtype=torch.int64)))
            self._slot_tail = []
        return self._slots

    @slots.setter
    def slots(self, value: torch.Tensor) -> None:
        self._slots = value
        self._slot_tail = []
        self.share_chain = None

    def append_slot(self, slot: int) -> None:
        """One more slot at the end of ``slots`` (a decode step's)."""
        self._slot_tail.append(slot)

    def finish(self, reason: str) -> None:
        """The one writer of ``finish_reason``: the first reason stays, except that a stop (a
        stop string, or a grammar that completed) on the token that also reached the length
        limit wins over "length"."""
        if self.finish_reason is None or (self.finish_reason == "length" and reason == "stop"):
            self.finish_reason = reason

    @property
    def seq(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``seq[start:end]`` without building ``seq``."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_lp_start(self) -> int | None:
        """First prompt position whose logprob is wanted (None: none are)."""
        start = self.params.prompt_logprobs_from
        return None if start is None else max(start, 1)

    @property
    def prompt_lp_missing(self) -> int | None:
        """First prompt position whose logprob is wanted and not yet computed (None: none)."""
        start = self.prompt_lp_start
        if start is None or start + len(self.prompt_logprobs) >= len(self.prompt_ids):
            return None
        return start + len(self.prompt_logprobs)

    @property
    def is_follower(self) -> bool:
        return self.group is not None and self.index > 0

    @property
    def num_output(self) -> int:
        """Generated tokens known on the host."""
        return len(self.output_ids) - self.unresolved

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def private_len(self) -> int:
        return self.kv_len - self.cached_len
