"""Batched sampling on the worker's device: penalties, logit bias, temperature, top-k/p, min-p, logprobs.

Randomness comes from a counter-based hash of (request seed, token index, token id), so a
request's draws do not depend on what else is in the batch, on preemption, or on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixd.core.forward_batch import SamplingBatch, StepOutput
from radixd.core.triton_ops import argmax_rows

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32 (no overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) per (row, token): ``seeds``/``steps`` [S], ``token_ids`` [S, K] -> [S, K] float32.

    The open interval matters: 23 bits keep ``(k + 0.5) / 2**23`` exact in float32, so no draw
    rounds to 1.0 (24 bits did: ``-log(1.0) == -0.0`` turned dropped tokens' ``0 / -0.0`` into
    NaN, which ``argmax`` picks)."""
    key = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (steps & _M32))
    h = _mix32(key[:, None] ^ _mix32(token_ids + 0x9E3779B9 & _M32))
    h = _mix32(h ^ 0x27D4EB2F)
    return ((h >> 9).float() + 0.5) / float(1 << 23)


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> None:
    if sb.rep_rows is not None and sb.repetition_penalty is not None:
        rows, toks = sb.rep_rows, sb.rep_tokens
        score = logits[rows, toks]
        pen = sb.repetition_penalty[rows]
        logits[rows, toks] = torch.where(score > 0, score / pen, score * pen)
    if sb.penalty_rows is not None and sb.penalty_rows.numel():
        counts = torch.zeros_like(logits)
        counts.index_put_((sb.penalty_rows, sb.penalty_tokens), torch.ones_like(sb.penalty_tokens, dtype=logits.dtype), accumulate=True)
        logits -= sb.frequency_penalty[:, None] * counts + sb.presence_penalty[:, None] * (counts > 0)


@dataclass
class SampledTokens:
    """A step's picks, on the device; ``start_copy`` queues their copy to the host."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_ranks: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_vals: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # embedding requests' pooled rows (ForwardBatch.pool_rows)
    aux: torch.Tensor | None = None  # the target's streams an EAGLE-3 drafter reads (stays on the device)
    # Tensor parallel: every shard's own copy of ``tokens`` (on its device) when each shard
    # sampled the same picks itself; None when only the first shard sampled.
    shard_tokens: list[torch.Tensor] | None = None
    _host: tuple | None = None
    _done: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Queue device-to-host copies into page-locked memory and an event after them, so
        that reading waits on the event (which lets go of the GIL) rather than on a copy."""
        if not self.tokens.is_cuda:
            return
        parts = self._parts()
        self._host = tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                           for t in parts)
        self._done = torch.cuda.Event()
        self._done.record()

    def _parts(self) -> tuple:
        return (self.tokens, self.logprobs, self.top_ids, self.top_vals, self.prompt_logprobs, self.prompt_ranks,
                self.prompt_top_ids, self.prompt_top_vals, self.pooled)

    def to_output(self) -> StepOutput:
        parts = self._parts()
        if self._done is not None:
            self._done.synchronize()
            parts = self._host
        tokens, logprobs, top_ids, top_vals, prompt_lp, prompt_rank, prompt_top_ids, prompt_top_vals, pooled = parts
        out = StepOutput(next_tokens=tokens.tolist(), pooled=pooled, aux=self.aux)
        if prompt_lp is not None:
            out.prompt_logprobs, out.prompt_ranks = prompt_lp.tolist(), prompt_rank.tolist()
            if prompt_top_ids is not None:
                out.prompt_top = _pairs(prompt_top_ids, prompt_top_vals)
        if logprobs is not None:
            out.logprobs = logprobs.tolist()
            if top_ids is not None:
                out.top_logprobs = _pairs(top_ids, top_vals)
        return out


def _pairs(ids: torch.Tensor, vals: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Per row, (token id, logprob) of its top alternatives."""
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]


def sample(logits: torch.Tensor, sb: SamplingBatch) -> StepOutput:
    """Pick one token per row of ``logits`` [S, V] (float32; modified in place)."""
    return sample_on_device(logits, sb).to_output()


def sample_on_device(logits: torch.Tensor, sb: SamplingBatch) -> SampledTokens:
    """As ``sample``, without waiting for the device."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if sb.want_logprobs else None
    apply_penalties(logits, sb)
    if sb.bias_rows is not None:
        logits.index_put_((sb.bias_rows, sb.bias_tokens), sb.bias_values, accumulate=True)
    if sb.banned_rows is not None and sb.banned_rows.numel():
        logits[sb.banned_rows, sb.banned_tokens] = float("-inf")
    allowed = sb.allowed
    if allowed is None and sb.allowed_future is not None:  # filled while the forward ran
        allowed = sb.allowed_future.result().to(logits.device, non_blocking=True)
    if allowed is not None:  # grammar constraints, in place
        logits.masked_fill_(~allowed, float("-inf"))
    greedy_tokens = argmax_rows(logits)
    if sb.all_greedy:
        tokens = greedy_tokens
    else:
        greedy = sb.temperature == 0
        temp = torch.where(greedy, torch.ones_like(sb.temperature), sb.temperature)
        # Shift by the row max first: a tiny temperature then sends the others to -inf
        # instead of overflowing several to +inf (a tie that could lose the argmax).
        scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temp[:, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
        k = torch.where(sb.top_k > 0, sb.top_k, torch.full_like(sb.top_k, scaled.shape[-1]))
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs
        # Nucleus: the smallest prefix whose mass reaches top_p (a token whose predecessors
        # already hold top_p is outside it). top_p == 1 is off: float cumsums can reach 1.0
        # before the tail, which must not drop tiny-probability tokens.
        top_p = sb.top_p[:, None]
        drop = ((before >= top_p) & (top_p < 1.0)) | (probs < sb.min_p[:, None] * probs[:, :1])
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
        noise = uniform_noise(sb.seeds, sb.steps, sorted_ids)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        # Dropped tokens get -1 outright so no rounding can make them win.
        race = torch.where(probs > 0, probs / -torch.log(noise), torch.full_like(probs, -1.0))
        choice = race.argmax(dim=-1)
        sampled = sorted_ids.gather(1, choice[:, None])[:, 0]
        tokens = torch.where(greedy, greedy_tokens, sampled)
    out = SampledTokens(tokens=tokens)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        if sb.top_logprobs:
            out.top_vals, out.top_ids = raw_logprobs.topk(sb.top_logprobs, dim=-1)
    return out
