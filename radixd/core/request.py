"""A request's state as the scheduler sees it.

Life cycle: WAITING -> RUNNING (has a table row and KV) -> FINISHED; preemption sends a
RUNNING request back to WAITING with its generated tokens kept and its KV given back.
Its KV (table row, slots, how far computed and cached, its lock in the radix tree) is one
``KVHandle`` (``Request.kv``), whose docstring states who owns which slots.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixd.core.constraints import Matcher
from radixd.core.kv_handle import KVHandle
from radixd.core.pooling import PoolState
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
    kv: KVHandle = field(default_factory=KVHandle)  # changed by the KV manager only
    finish_reason: str | None = None
    aborted: bool = False
    cached_tokens: int | None = None      # prompt tokens served from the cache (first admission)
    preemptions: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)  # from prompt_lp_start on
    prompt_ranks: list[int] = field(default_factory=list)       # their ranks (1: the argmax)
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)  # with prompt_top_logprobs
    matcher: Matcher | None = None        # grammar matcher (a backend's) if constrained
    sampling_row: tuple | None = None     # constant sampling inputs, filled by the scheduler
    pool: PoolState | None = None         # an embedding request: pools its prompt, samples nothing
    draft_len: int = 0                    # speculative decoding: tokens to draft next (0: the most;
                                          # below 0: steps to decode plainly first)

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
    def prefilling(self) -> bool:
        """Prompt tokens are left to compute before it decodes (an embedding request: before
        it is done; it never decodes)."""
        return self.kv.length < self.seq_len - (self.pool is None)

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

