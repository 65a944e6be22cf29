"""Parsers over terminal indices, as the automaton (``TokenGrammar``) drives them: the
``Parser`` protocol, an LALR(1) parser over Lark's table and a one-terminal parser for a regex.
Stacks are tuples of parser states, immutable, so configurations that hold them can be cached.
"""

from __future__ import annotations

from typing import Protocol


class Parser(Protocol):
    start: tuple                          # the stack before any terminal
    actions: dict[int, dict[int, tuple]]  # state -> terminal -> (True, state) shift or
                                          # (False, rule, length) reduce; the warm-up reads it

    def feed(self, stack: tuple, term: int) -> tuple | None:
        """The stack after terminal ``term``, or None if the parser refuses it."""

    def candidates(self, stack: tuple) -> tuple[int, ...]:
        """The terminals the top state names (a superset of what ``feed`` takes)."""

    def accepts_end(self, stack: tuple) -> bool:
        """Whether the text may end here."""


class SingleTerminalParser:
    """The whole text is terminal 0 (a regex constraint); no table to warm up from."""

    start = (0,)
    actions: dict[int, dict[int, tuple]] = {}

    def feed(self, stack: tuple, term: int) -> tuple | None:
        return (1,) if stack == (0,) and term == 0 else None

    def candidates(self, stack: tuple) -> tuple[int, ...]:
        return (0,) if stack == (0,) else ()

    def accepts_end(self, stack: tuple) -> bool:
        return stack == (1,)


class LalrParser:
    """Drives a Lark LALR(1) table; stacks are tuples of parser states."""

    def __init__(self, parse_table, term_ids: dict[str, int], end_id: int, start: str = "start"):
        self.actions: dict[int, dict[int, tuple]] = {}
        self.goto: dict[int, dict[str, int]] = {}
        for state, row in parse_table.states.items():
            acts, gotos = {}, {}
            for sym, (action, arg) in row.items():
                is_shift = action.name == "Shift"
                if sym == "$END":
                    acts[end_id] = (True, arg) if is_shift else (False, arg.origin.name, len(arg.expansion))
                elif sym in term_ids:
                    acts[term_ids[sym]] = (True, arg) if is_shift else (False, arg.origin.name, len(arg.expansion))
                else:
                    gotos[sym] = arg
            self.actions[state] = acts
            self.goto[state] = gotos
        self.start = (parse_table.start_states[start],)
        self.end_state = parse_table.end_states[start]
        self.end_id = end_id
        self._cands: dict[int, tuple[int, ...]] = {}

    def feed(self, stack: tuple, term: int) -> tuple | None:
        while True:
            act = self.actions[stack[-1]].get(term)
            if act is None:
                return None
            if act[0]:
                return stack + (act[1],)
            n = act[2]
            if n:
                stack = stack[:-n]
            stack = stack + (self.goto[stack[-1]][act[1]],)
            if term == self.end_id and stack[-1] == self.end_state:
                return stack

    def candidates(self, stack: tuple) -> tuple[int, ...]:
        top = stack[-1]
        c = self._cands.get(top)
        if c is None:
            c = self._cands[top] = tuple(t for t in self.actions[top] if t != self.end_id)
        return c

    def accepts_end(self, stack: tuple) -> bool:
        return self.feed(stack, self.end_id) is not None
