"""Prompt chunks' attention in cuDNN's fused kernels, over a fixed set of execution plans.

cuDNN runs an attention shape only through an execution plan built for it: about 70 ms on an
H200, about 1 s where a kernel variant is compiled. torch keys its plans by the exact shape,
unless ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (torch 2.9 and later; read once, at the
process's first cuDNN attention): then q, k, v and the output in BSHD layout (each token's
heads side by side, the whole contiguous) run through cuDNN's ragged entry, and the plan's
key holds the sequence lengths rounded up to powers of two (``bucket``) with the batch, the
heads, the causal flag and whether the log-sum-exp is returned as they are
(aten/src/ATen/native/cudnn/MHA.cpp: ``use_ragged_in_dense``, ``setMHAParams``). One plan
serves every length in (S/2, S]. The price: on an H200, 8B shape, such a call runs 3-9%
longer than with an exact-shape plan, plus about 27 us of small kernels torch adds to each
(``benchmarks.cudnn_buckets``). So where every call of a step has an exact-shape plan built at
start too (fresh prompts of a power-of-two length: every long prompt's first chunk; a chunk of
exactly the chunk size after whole chunks), q stays strided as the q/k/v projection leaves it
(not BSHD-contiguous: torch takes the exact-shape plan) and the step runs as with exact plans.
``DensePlans`` sets the variable when it is made, builds the plans of every ``Key`` a step can
ask for (``warm_up``, on the thread that runs the steps: torch's plan cache is per thread) and
checks that a length it did not build takes no plan.
A step's extends then attend as (``plan``):

* a run of consecutive fresh prompts of one length n: causal calls of a power-of-two batch
  each (a run of 7 in calls of 4, 2 and 1);
* a chunk after a short cached prefix (p < ``min_tokens`` or 4p <= n): one causal call over
  its p + n keys, q led by p zero rows whose outputs are dropped (top-left causal over p + n
  is then what each of its own n rows must see);
* a chunk after a longer prefix: over the prefix (no mask) and over its own keys (causal),
  the two merged by their log-sum-exps (``merge_lse``).

Extends shorter than ``min_tokens``, and any whose ``Key`` was not built (longer than the
engine's chunk, a batch past the step budget, another thread), go to the caller's extend
kernel: a step never builds a plan. A fused call also costs the host much more than the extend
kernel's launch, which shows where a step's device work is small (a batch-1 prompt of a few
thousand tokens at the 8B shape): the caller takes the fused calls only for a step whose layer
work (``layer_flops``) is at least ``CALL_FLOPS`` per call. On the CPU (tests) torch's flash kernel stands in,
nothing is planned, and every wanted key counts as built.

q comes from the caller contiguous ([T, H, D]: ``rope_store``'s ``q_out``), or strided for a
step of exact-shape plans; the step's K and V from the pool: views where its slots ascend
without gaps, else gathered once; a prefix's K/V are gathered through the request's table row.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

BUCKET_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
MIN_TOKENS = 256  # an extend attends here from this many new tokens
MAX_CALLS = 32  # fused calls per layer at most (the rest of the step's extends: the extend kernel)
PLANNED_S = 0.01  # a warm call's wall time above this means cuDNN built a plan in it (about 0.07 s)
EXACT_PREFIXES = 16  # exact-shape plans for chunks after at most this many whole chunks
# A fused call costs the host more than the extend kernel's launch (an H200: 138-250 us with a
# bucketed plan, 36-60 with an exact one, 36-76 for the kernel; benchmarks.cudnn_buckets
# --host), and with every long extend fused batch-1 prompts of 257-4000 tokens took about 17
# ms longer (benchmarks.prefill_lengths; docs/benchmarks/gpu_wave2.md): a step takes the
# fused calls only where its layer's device work (``layer_flops``) is at least this much per
# call, between the 2048-token steps that were slower and the 8192-token ones that were faster.
CALL_FLOPS = 1.5e12


def enable_buckets() -> bool:
    """Ask torch for bucketed plans (``BUCKET_ENV``, unless the environment sets it): effective
    only before the process's first cuDNN attention. Whether it is asked for."""
    return os.environ.setdefault(BUCKET_ENV, "1") == "1"


def bucket(n: int) -> int:
    """The power of two that a length ``n`` >= 1 rounds up to in a plan's key."""
    return 1 << (n - 1).bit_length()


class Key(NamedTuple):
    """One cuDNN plan: what torch keys it by."""

    causal: bool
    lse: bool  # the log-sum-exp returned too
    batch: int
    q_len: int  # the query length's bucket (``exact``: the length)
    kv_len: int  # the key length's bucket (``exact``: the length)
    exact: bool = False  # an exact-shape plan, q strided as the q/k/v projection leaves it


class DenseStep(NamedTuple):
    """A step's fused attention (``plan``); token offsets are into the step's [T, H, D]."""

    first: int | None  # the step's first slot where its slots ascend without gaps, else None (K/V gathered)
    fresh: list[tuple[int, int, int]]  # (first token, prompts, tokens each): causal calls
    joined: list[tuple[int, int, int, int]]  # (first token, tokens, table row, prefix): one call over both
    split: list[tuple[int, int, int, int]]  # (first token, tokens, table row, prefix): two calls, merged
    rest: list[int]  # positions (in the extends planned) left to the extend kernel
    tokens: int  # the tokens of the extends planned
    exact: bool  # every call has an exact-shape plan (q may stay strided: no bucketed plan's costs)


def layer_flops(tokens: int, width: int, extends: list[tuple[int, int]]) -> float:
    """A rough count of one layer's device work in a step of ``tokens`` tokens for a model of
    ``width`` = heads x head dim: its projections and MLP (24 width^2 a token, a Llama-shaped
    layer) and the causal attention of ``extends`` ((new tokens, prefix) each)."""
    return 24.0 * width * width * tokens + sum(4.0 * width * n * (p + (n + 1) / 2) for n, p in extends)


def joins(prefix: int, n: int, min_tokens: int) -> bool:
    """Whether a chunk of ``n`` tokens after ``prefix`` attends in one call (module docstring):
    the p zero rows cost p^2 / 2 scores against the chunk's n p + n^2 / 2, at most a third more."""
    return prefix < min_tokens or 4 * prefix <= n


def plan(extend_lens: list[int], prefix_lens: list[int], rows: list[int], starts: list[int], ready,
         min_tokens: int = MIN_TOKENS) -> tuple[list, list, list, list[int], bool]:
    """The calls of a step's extends (their new tokens, prefixes, table rows and first tokens,
    in the step's order) whose bucketed keys ``ready(key)`` has: (fresh, joined, split, rest,
    exact) as in ``DenseStep``."""
    fresh, joined, split, rest = [], [], [], []
    exact = True
    calls = 0
    i, count = 0, len(extend_lens)
    while i < count:
        n, p = extend_lens[i], prefix_lens[i]
        s = bucket(n)
        if n < min_tokens:
            rest.append(i)
            i += 1
            continue
        if p == 0:  # the run of consecutive fresh prompts of this length, in power-of-two batches
            j = i
            while j < count and extend_lens[j] == n and prefix_lens[j] == 0:
                j += 1
            at = i
            while at < j:
                b = 1 << ((j - at).bit_length() - 1)
                while b > 1 and not ready(Key(True, False, b, s, s)):
                    b //= 2
                if calls >= MAX_CALLS or not ready(Key(True, False, b, s, s)):
                    rest.extend(range(at, j))
                    break
                fresh.append((starts[at], b, n))
                exact = exact and ready(Key(True, False, b, n, n, True))
                calls += 1
                at += b
            i = j
            continue
        if joins(p, n, min_tokens):
            keys, exact_keys = [Key(True, False, 1, bucket(p + n), bucket(p + n))], [None]
        else:
            keys = [Key(False, True, 1, s, bucket(p)), Key(True, True, 1, s, s)]
            exact_keys = [Key(False, True, 1, n, p, True), Key(True, True, 1, n, n, True)]
        if calls + len(keys) <= MAX_CALLS and all(map(ready, keys)):
            (joined if len(keys) == 1 else split).append((starts[i], n, rows[i], p))
            exact = exact and all(k is not None and ready(k) for k in exact_keys)
            calls += len(keys)
        else:
            rest.append(i)
        i += 1
    return fresh, joined, split, rest, exact and calls > 0


def wanted(min_tokens: int, max_extend: int, max_tokens: int, max_context: int) -> list[Key]:
    """Every key a step can ask for: extends of ``min_tokens`` to ``max_extend`` new tokens, at
    most ``max_tokens`` of them in a step, after prefixes up to ``max_context`` tokens."""
    keys = set()
    lo = bucket(min_tokens)
    top_kv = bucket(max_context)
    s = lo
    while s <= bucket(max_extend):
        least = max(min_tokens, s // 2 + 1)  # the shortest extend of this bucket
        b = 1
        while b * least <= max_tokens:
            keys.add(Key(True, False, b, s, s))
            b *= 2
        keys.add(Key(True, True, 1, s, s))
        kv = max(lo, s // 4)  # (a split prefix is longer than a quarter of its chunk, which is over s / 2)
        while kv <= top_kv:
            keys.add(Key(False, True, 1, s, kv))
            kv *= 2
        s *= 2
    s = lo
    while s <= bucket(min(max_extend + max(min_tokens - 1, max_extend // 4), max_context)):
        keys.add(Key(True, False, 1, s, s))  # joined chunks
        s *= 2
    # exact shapes: fresh prompts of a power-of-two length, and chunks of exactly the chunk
    # size after whole chunks (a long prompt's, nothing cached)
    s = lo
    while s <= max_extend:
        b = 1
        while b * s <= max_tokens:
            keys.add(Key(True, False, b, s, s, True))
            b *= 2
        s *= 2
    c = max_extend
    if c == bucket(c) and c >= min_tokens:
        keys.add(Key(True, True, 1, c, c, True))
        for k in range(1, min(EXACT_PREFIXES, (max_context - c) // c) + 1):
            keys.add(Key(False, True, 1, c, k * c, True))
    return sorted(keys)


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
          lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q [B, H, L, D] over k/v [B, Hkv, S, D] (``causal``: top-left) and, with
    ``lse``, its log-sum-exp [B, H, L, 1] (float32): cuDNN's kernel on CUDA (grouped K/V
    heads read as they are), the flash kernel on the CPU."""
    if q.is_cuda:
        o, sums = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False,
                                                                      scale=scale)[:2]
    else:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o, sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, (sums.reshape(*q.shape[:3], 1).float() if lse else None)


def merge_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output and log-sum-exp."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def bshd(t: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch * L, heads, D] -> [batch, heads, L, D] (a view: BSHD in memory)."""
    return t.view(batch, -1, *t.shape[1:]).transpose(1, 2)


def attend(step: DenseStep, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor,
           table: torch.Tensor, scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """The step's fused calls: q [T, H, D] contiguous (rotated), K/V in the pool (``loc``: the
    step's slots); each output into ``out`` [T, H, D], or, with ``out`` None (one fresh call
    that is the whole step), that call's output as [T, H, D]."""
    T, H, D = q.shape
    if step.first is not None:
        k, v = k_buf[step.first:step.first + T], v_buf[step.first:step.first + T]
    else:
        k, v = k_buf[loc], v_buf[loc]
    for start, count, n in step.fresh:
        span = slice(start, start + count * n)
        o = fused(bshd(q[span], count), bshd(k[span], count), bshd(v[span], count), True, scale, False)[0]
        if out is None:
            return o.transpose(1, 2).reshape(T, H, D)
        out[span].view(count, n, H, D).copy_(o.transpose(1, 2))
    for start, n, row, p in step.joined:
        span = slice(start, start + n)
        qf = torch.zeros((p + n, H, D), dtype=q.dtype, device=q.device)
        qf[p:] = q[span]
        slots = table[row, :p + n]
        o = fused(bshd(qf, 1), bshd(k_buf[slots], 1), bshd(v_buf[slots], 1), True, scale, False)[0]
        out[span].copy_(o[0, :, p:].transpose(0, 1))
    for start, n, row, p in step.split:
        span = slice(start, start + n)
        slots = table[row, :p]
        qs = bshd(q[span], 1)
        o1, l1 = fused(qs, bshd(k_buf[slots], 1), bshd(v_buf[slots], 1), False, scale, True)
        o2, l2 = fused(qs, bshd(k[span], 1), bshd(v[span], 1), True, scale, True)
        out[span].view(1, n, H, D).copy_(merge_lse(o1, l1, o2, l2).transpose(1, 2))
    return out


class Warm(NamedTuple):
    """What ``DensePlans.warm_up`` did."""

    plans: int  # keys built
    seconds: float
    bucketed: bool  # a length it did not build took no plan (else nothing counts as built)


class DensePlans:
    """The keys a backend's fused calls may take (module docstring): on CUDA those built by
    ``warm_up`` on the thread asking; on the CPU every wanted key. ``q_strides``: q's strides
    as the q/k/v projection leaves it ([T, H, D] in rows of q, k and v heads), which an exact
    plan is built for.

    Contract: made before the process's first cuDNN attention (it sets ``BUCKET_ENV``, which
    torch reads then); ``warm_up`` runs once, on the thread that will run the steps, with the
    pool idle (it reads the pool's buffers as scratch K/V)."""

    def __init__(self, *, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_extend: int, max_tokens: int, max_context: int, min_tokens: int | None = None):
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.q_strides = ((heads + 2 * kv_heads) * head_dim, head_dim, 1)
        self.min_tokens = MIN_TOKENS if min_tokens is None else min_tokens
        self.keys = wanted(self.min_tokens, max_extend, max_tokens, max_context)
        self.cuda = device.type == "cuda"
        self.built: frozenset[Key] = frozenset(self.keys) if not self.cuda else frozenset()
        self.thread: int | None = None
        self.warm: Warm | None = None  # what warm_up did
        if self.cuda:
            enable_buckets()

    def ready(self, key: Key) -> bool:
        return key in self.built and (not self.cuda or threading.get_ident() == self.thread)

    def warm_up(self, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Warm:
        """Build every key's plan on this thread (K/V: a layer's pool buffers, as scratch),
        then check that bucketing is in effect: a fresh length inside a built bucket must take
        no plan. If it is not (the variable was off at the process's first cuDNN attention),
        nothing counts as built and the steps keep the extend kernel."""
        if not self.cuda:
            self.warm = Warm(0, 0.0, True)
            return self.warm
        t0 = time.perf_counter()
        slots = k_buf.shape[0]
        longest = max(max(k.batch * k.q_len for k in self.keys), max(k.q_len for k in self.keys))
        rows = torch.zeros((longest, self.q_strides[0]), dtype=self.dtype, device=self.device)
        strided = rows[:, :self.heads * self.head_dim].view(longest, self.heads, self.head_dim)
        q = torch.zeros((longest, self.heads, self.head_dim), dtype=self.dtype, device=self.device)
        built, failed = [], []
        for key in self.keys:
            b, sq, skv = key.batch, key.q_len, min(key.kv_len, slots - 1)
            if (skv != key.kv_len and (key.exact or bucket(skv) != key.kv_len)) or b * max(sq, skv) >= slots:
                continue  # (longer than the pool: never asked for)
            k, v = (bshd(t[1:1 + b * skv], b) for t in (k_buf, v_buf))
            try:
                fused(bshd((strided if key.exact else q)[:b * sq], b), k, v, key.causal, 1.0, key.lse)
            except RuntimeError as exc:  # (a GPU, torch or cuDNN without this shape: the extend kernel's)
                failed.append((key, exc))
                continue
            built.append(key)
        torch.cuda.synchronize(self.device)
        if failed:
            log.warning("dense prefill: cuDNN refused %d of %d attention shapes (first: %s: %s); those keep "
                        "the extend kernel", len(failed), len(self.keys), failed[0][0], failed[0][1])
        probe = self._probe(q, k_buf, v_buf, built)
        seconds = time.perf_counter() - t0
        if probe is None:
            log.warning("dense prefill: cuDNN built a plan for a length inside a built bucket (%s was "
                        "not set at the process's first cuDNN attention?); long prompt chunks keep the "
                        "extend kernel", BUCKET_ENV)
            self.warm = Warm(len(built), seconds, False)
            return self.warm
        self.built, self.thread = frozenset(built), threading.get_ident()
        log.info("dense prefill: %d cuDNN attention plans built in %.2f s", len(built), seconds)
        self.warm = Warm(len(built), seconds, True)
        return self.warm

    def _probe(self, q, k_buf, v_buf, built) -> float | None:
        """The wall time of a fresh causal call of a length that no key was built at, inside
        the smallest built bucket; None where that call built a plan."""
        key = min((k for k in built if k.causal and not k.lse and k.batch == 1 and not k.exact), default=None)
        if key is None or key.q_len < 2:
            return None
        n = key.q_len * 3 // 4 + 1
        t0 = time.perf_counter()
        fused(bshd(q[:n], 1), bshd(k_buf[1:1 + n], 1), bshd(v_buf[1:1 + n], 1), True, 1.0, False)
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        return took if took < PLANNED_S else None
