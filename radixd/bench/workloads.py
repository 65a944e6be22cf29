"""Workloads of ``radixd bench``, generated locally and reproducible from ``--seed``.

A workload is a list of sessions; a session is a list of turns sent one after the other
(one turn for ``random`` and ``shared-prefix``; for ``multi-turn`` each turn resends the
whole conversation so far). Text is sampled from a fixed word list and tokenized with the
given tokenizer: every piece has its token ids (sent to the native and completions routes,
the engine and the hf peer) and its text (sent to the chat route).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn", "json")

# A fixed word list: prompts look like text to the tokenizer and are reproducible.
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river garden window music
market energy language paper light table value answer query model request cache memory token
server engine batch prefix green quiet small large early late open close bright heavy simple
ancient modern careful gentle sudden rapid slow warm cold deep wide narrow strong weak rich
walks carries finds builds reads writes opens closes follows holds brings keeps leaves meets
runs moves turns shows hears plays learns grows begins seems helps talks becomes includes
and or but because while after before under over between through during without within
""".split()


@dataclass
class Piece:
    """A run of prompt text: its token ids and the text they decode to."""

    ids: list[int]
    text: str


@dataclass
class Turn:
    user: Piece
    output_len: int


@dataclass
class Session:
    id: int
    turns: list[Turn]
    system: Piece | None = None
    group: int | None = None


@dataclass
class RequestSpec:
    """One request as the targets see it: token ids (native, completions, engine, hf) and
    chat messages (the chat route) of the same content."""

    input_ids: list[int]
    messages: list[dict]
    output_len: int
    session: int = 0
    turn: int = 0
    group: int | None = None


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    config: dict
    tokenizer: object = field(repr=False, default=None)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def spec(self, session: Session, k: int, outputs: list[tuple[list[int] | None, str]]) -> RequestSpec:
        """Turn ``k`` of ``session``: the system prompt, every earlier turn with the reply it
        got (``outputs[j]``: token ids when the target returned them, and text), then turn ``k``."""
        ids: list[int] = []
        messages: list[dict] = []
        if session.system is not None:
            ids += session.system.ids
            messages.append({"role": "system", "content": session.system.text})
        for j in range(k):
            ids += session.turns[j].user.ids
            messages.append({"role": "user", "content": session.turns[j].user.text})
            out_ids, out_text = outputs[j]
            if out_ids is None:  # the route returned text only: its tokens, as well as we can tell
                out_ids = self.tokenizer(out_text, add_special_tokens=False).input_ids if out_text else []
            ids += out_ids
            messages.append({"role": "assistant", "content": out_text})
        ids += session.turns[k].user.ids
        messages.append({"role": "user", "content": session.turns[k].user.text})
        return RequestSpec(ids, messages, session.turns[k].output_len, session.id, k, session.group)

    def describe(self) -> dict:
        prompt_tokens = [len(self.spec(s, 0, []).input_ids) for s in self.sessions]
        return {
            "name": self.name,
            **self.config,
            "sessions": len(self.sessions),
            "requests": self.num_requests,
            "first_turn_prompt_tokens": sum(prompt_tokens),
            "requested_output_tokens": sum(t.output_len for s in self.sessions for t in s.turns),
        }


class UsageError(Exception):
    """A request ``radixd bench`` cannot carry out as given (exit status 2)."""


class UnsupportedWorkload(UsageError):
    """A workload radixd cannot run yet."""


def parse_range(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (inclusive), both >= 1."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"expected N or MIN:MAX, got {text!r}") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ValueError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


class _Sampler:
    """Word-list text of an exact token length, with distinct first tokens where asked."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng

    def piece(self, n: int, avoid_first: set[int] | None = None) -> Piece:
        for _ in range(50):
            ids = self._ids(n)
            if avoid_first is None or ids[0] not in avoid_first:
                break
        if avoid_first is not None:
            avoid_first.add(ids[0])
        return Piece(ids, self.tok.decode(ids))

    def _ids(self, n: int) -> list[int]:
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < n:
            words.extend(self.rng.choice(WORDS) for _ in range(max(8, n - len(ids))))
            text = " ".join(words)
            ids = self.tok(text[0].upper() + text[1:], add_special_tokens=False).input_ids
        return ids[:n]


def _draw(rng: random.Random, r: tuple[int, int]) -> int:
    return r[0] if r[0] == r[1] else rng.randint(r[0], r[1])


def build(name: str, tokenizer, *, seed: int, num_prompts: int = 64, input_len: tuple[int, int] = (1024, 1024),
          output_len: tuple[int, int] | None = None, groups: int = 64, prompts_per_group: int = 16,
          system_len: int = 2048, question_len: int = 128, conversations: int = 16, turns: int = 4,
          turn_len: tuple[int, int] = (128, 128)) -> Workload:
    """The workload ``name``; ``output_len`` None: the workload's default."""
    rng = random.Random(seed)
    s = _Sampler(tokenizer, rng)
    if name == "json":
        raise UnsupportedWorkload(
            "the json workload is not in radixd bench yet; grammar-constrained throughput is measured "
            "by benchmarks/grammar_bench.py")
    if name == "random":
        out = output_len or (128, 128)
        firsts: set[int] = set()
        sessions = [Session(i, [Turn(s.piece(_draw(rng, input_len), firsts), _draw(rng, out))])
                    for i in range(num_prompts)]
        config = {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": list(out)}
    elif name == "shared-prefix":
        out = output_len or (256, 256)
        sessions = []
        sys_firsts: set[int] = set()
        for g in range(groups):
            system = s.piece(system_len, sys_firsts)
            q_firsts: set[int] = set()
            for _ in range(prompts_per_group):
                sessions.append(Session(len(sessions), [Turn(s.piece(question_len, q_firsts), _draw(rng, out))],
                                        system=system, group=g))
        rng.shuffle(sessions)  # groups interleaved, as in real traffic
        for i, sess in enumerate(sessions):
            sess.id = i
        config = {"groups": groups, "prompts_per_group": prompts_per_group, "system_len": system_len,
                  "question_len": question_len, "output_len": list(out),
                  "theoretical_max_hit_rate": (groups * (prompts_per_group - 1) * system_len)
                  / (groups * prompts_per_group * (system_len + question_len))}
    elif name == "multi-turn":
        out = output_len or (128, 128)
        firsts = set()
        sessions = []
        for c in range(conversations):
            ts = [Turn(s.piece(_draw(rng, turn_len), firsts if k == 0 else None), _draw(rng, out))
                  for k in range(turns)]
            sessions.append(Session(c, ts))
        config = {"conversations": conversations, "turns": turns, "turn_len": list(turn_len),
                  "output_len": list(out)}
    else:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    config["seed"] = seed
    return Workload(name, sessions, config, tokenizer)


def warmup_spec(tokenizer, seed: int, output_len: int = 4) -> RequestSpec:
    """A short prompt unrelated to the workload (its cache entries are flushed after)."""
    p = _Sampler(tokenizer, random.Random(seed + 7919)).piece(16)
    return RequestSpec(p.ids, [{"role": "user", "content": p.text}], output_len, -1, 0)
