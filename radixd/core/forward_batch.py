"""What one forward pass computes: a ragged batch of requests, each extending its KV.

A request in the batch has ``prefix_len`` tokens already in the pool and ``extend_len`` new
tokens to run (1 for a decode step, a prompt chunk for prefill). Tokens of all requests are
laid out back to back in ``input_ids``/``positions``/``out_cache_loc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for the requests that pick a token this step."""

    temperature: torch.Tensor        # [S] float32, 0 = greedy
    top_p: torch.Tensor              # [S] float32
    top_k: torch.Tensor              # [S] int64, 0 = off
    min_p: torch.Tensor              # [S] float32
    seeds: torch.Tensor              # [S] int64
    steps: torch.Tensor              # [S] int64: index of the token being drawn (for the RNG)
    # Penalties (None when no row uses them).
    repetition_penalty: torch.Tensor | None = None  # [S]
    frequency_penalty: torch.Tensor | None = None   # [S]
    presence_penalty: torch.Tensor | None = None    # [S]
    penalty_rows: torch.Tensor | None = None        # [P] row of each (token) entry below
    penalty_tokens: torch.Tensor | None = None      # [P] generated token ids (frequency/presence)
    rep_rows: torch.Tensor | None = None            # [R] row of each seen token (repetition)
    rep_tokens: torch.Tensor | None = None          # [R] prompt + generated token ids
    # logit_bias: ``bias_values`` added to the logits at (``bias_rows``, ``bias_tokens``).
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None          # float32
    # Tokens banned this step (min_new_tokens not reached: EOS and stop ids).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # Grammar masks: [S, V] bool, True = allowed (None when no row is constrained).
    allowed: torch.Tensor | None = None
    # ... or, under overlap scheduling, filled by the engine while the forward runs: the
    # sampler waits on ``allowed_future`` (rows and matchers in ``deferred_masks``).
    allowed_future: object | None = None
    deferred_masks: list | None = None
    top_logprobs: int = 0            # max top-k alternatives any row asked for
    want_logprobs: bool = False
    all_greedy: bool = False


@dataclass
class TokenTrees:
    """Token trees verified in a batch (``radixd.core.speculative.tree``): tree t is the
    ``sizes[t]`` one-token rows from batch row ``first[t]`` (its root; decode rows come first,
    so that is also its flat token index), of one request's table row at the table positions
    following the root's; ``masks[t]`` [size, size] bool: the rows each row's query sees
    besides the prefix (its ancestors and itself). Their ``positions`` are RoPE positions
    (the root's plus the depth), not table positions."""

    first: list[int]
    sizes: list[int]
    masks: list[torch.Tensor]

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` with each tree's rows at their table positions."""
        cols = positions.clone()
        for f, n in zip(self.first, self.sizes, strict=True):
            cols[f : f + n] = cols[f] + torch.arange(n)
        return cols


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    out_cache_loc: torch.Tensor      # [T] int64: the slot each new token's KV is written to
    rows: list[int]                  # [B] request-to-token row of each request
    prefix_lens: list[int]           # [B]
    extend_lens: list[int]           # [B]
    # Rows of the table to (re)write before running: (row, start position, slots).
    table_writes: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    # True: also write each new token's slot (out_cache_loc) at (its request's row, its
    # position); the scheduler sets this rather than list every request's new slots above.
    write_new_slots: bool = False
    # Tokens not known when the batch was built: flat positions, and where each comes from
    # (index into the previous step's picks). Filled in on the device by the worker.
    placeholder_pos: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)
    # Which requests pick a token this step (index into the B requests), and how.
    sample_indices: list[int] = field(default_factory=list)
    sampling: SamplingBatch | None = None
    # Prompt tokens whose log-probability was asked for: the flat index of the token before
    # each (whose logits predict it) and its id. Their logits follow the sampled rows'.
    prompt_lp_pos: list[int] = field(default_factory=list)
    prompt_lp_target: list[int] = field(default_factory=list)
    prompt_lp_top: int = 0  # top alternatives per such position (the most any request asks)
    # Embedding requests: the flat index of each position whose final hidden state is pooled,
    # and the row (one per request, ``pool_rows`` in all) its hidden state is summed into.
    pool_pos: list[int] = field(default_factory=list)
    pool_row: list[int] = field(default_factory=list)
    pool_rows: int = 0
    # KV loaded from lower cache tiers into this batch's slots on a side stream: per load,
    # one CUDA event per layer (layer l's attention waits for that layer's events only).
    wait_events: list = field(default_factory=list)
    # Sliding windows (radixd.core.swa_pool): (slots, window slots) to write into the pool's
    # ``to_window`` map before running; None: nothing changed.
    window_map: tuple[torch.Tensor, torch.Tensor] | None = None
    # A decode batch's requests that share a cached prefix (radixd.core.cascade.SharedPrefixes):
    # a backend decoding in cascade reads that KV once per item; None: every request alone.
    shared: object | None = None
    # Token trees verified here (their rows attend through a tree mask); None: none.
    trees: TokenTrees | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    def logits_indices(self) -> torch.Tensor:
        """Index in the flat token axis of the last token of each sampled request, then of
        each token before a prompt token whose logprob is wanted."""
        n = len(self.sample_indices)
        if not self.prompt_lp_pos and n == len(self.extend_lens) == self.input_ids.numel():
            return torch.arange(n, dtype=torch.int64)  # one token per request, every one sampled
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        idx = ends[torch.tensor(self.sample_indices, dtype=torch.int64)]
        if self.prompt_lp_pos:
            idx = torch.cat((idx, torch.tensor(self.prompt_lp_pos, dtype=torch.int64)))
        return idx


@dataclass
class StepOutput:
    """What the worker hands back: one entry per sampled request, in ``sample_indices`` order."""

    next_tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None  # in ``ForwardBatch.prompt_lp_pos`` order
    prompt_ranks: list[int] | None = None       # likewise
    prompt_top: list[list[tuple[int, float]]] | None = None  # likewise, ``prompt_lp_top`` each
    pooled: torch.Tensor | None = None  # [pool_rows, hidden] float32 sums, on the host
    # [tokens, streams * hidden], on the device: the residual streams after the layers an
    # EAGLE-3 drafter reads, at every token of the batch in flat order (``ModelWorker.aux_layers``)
    aux: torch.Tensor | None = None
