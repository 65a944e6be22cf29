"""Speculative decoding: a drafter guesses the next tokens of a decoding request, one target
forward checks them all, and every guess the target agrees with is a token gained.

    Scheduler.schedule -> Speculator.draft (per request: eligible? how many? the drafter's
      guesses d_1..d_k) -> the batch runs [last token, d_1..d_k] as k + 1 decode rows of the
      request's table row at consecutive positions (``verify_rows``): every row's K/V is
      stored before any row attends, so row j sees the prefix and rows < j, exactly a causal
      extend; a verify step is a decode batch (CUDA graphs and all), sampled per row
    -> Scheduler.process -> Speculator.accept (keep the picks up to the first that differs
      from its draft, free the rest's KV and placeholders) -> the usual per-pick loop

Exactness: the pick at position i is drawn from the target's distribution p_i there, with the
noise plain decoding uses for that token index; d_{i+1} is accepted iff the pick equals it, and
the first pick that differs is kept as the bonus token. For a draft that is a point proposal
(q = one token with probability 1: every built-in drafter proposes so) this *is* speculative
rejection sampling: accept d with probability p(d), else draw from (p - q)+ normalised, which
is p without d; so greedy and seeded sampled output equal plain decoding's token for token.

Token trees (``tree``): a drafter may propose several continuations sharing their first
tokens; their nodes run as the decode rows of one table row as a chain's do, each at RoPE
position root + depth, attending through a tree mask to the prefix and its own ancestors, and
the accepted path is the one that follows the picks.

Modules: ``drafter`` (the interface plugins implement), ``tree`` (token trees: shape, mask,
acceptance), ``speculator`` (per replica: which requests draft, how far, what a verify step
leaves, acceptance counters), ``draft_model`` (the ``standalone`` drafter: a smaller
checkpoint on a KV region of its own), ``eagle3_head`` and ``eagle3`` (the ``eagle3`` drafter:
an EAGLE-3 draft head in SGLang's layout, fed the model's own hidden states).
"""
