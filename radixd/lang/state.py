"""A program's state: its text so far, its named results, and an executor thread.

``s += expr`` queues ``expr`` and returns at once; the state's own thread runs its queue in
order against the back end, so states made by ``fork`` run their calls concurrently (and
their common text is a prefix the radix cache already holds). Reading (``s[name]``,
``s.text()``) waits for what was queued before it; a failed call surfaces there as a
``ProgramError`` naming it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from radixd.lang.expr import Concat, Expr, Gen, Role, Select, Text, as_expr

_END = object()


class ProgramError(RuntimeError):
    """A call of a program failed (the message names it and carries the server's reason)."""


@dataclass(frozen=True)
class ChatRoles:
    """The chat template's text around each role's content, found by rendering probes."""

    begin: dict[str, str]
    end: dict[str, str]
    first_user_begin: str      # a conversation opening with a user turn (templates may add a system turn)

    @classmethod
    def probe(cls, backend) -> ChatRoles:
        mark = "\x00radixd-content\x00"

        def render(msgs, gen=False):
            return backend.render_chat(msgs, gen)

        def around(before: str, msgs: list[dict]) -> tuple[str, str]:
            text = render(msgs)
            if not text.startswith(before) or mark not in text:
                raise ProgramError("the chat template does not render turns incrementally; use plain text")
            rest = text[len(before):]
            head, tail = rest.split(mark, 1)
            return head, tail

        sys_b, sys_e = around("", [{"role": "system", "content": mark}])
        sys_msg = {"role": "system", "content": "S"}
        usr_msg = {"role": "user", "content": "U"}
        usr_b, usr_e = around(render([sys_msg]), [sys_msg, {"role": "user", "content": mark}])
        as_b, as_e = around(render([sys_msg, usr_msg]), [sys_msg, usr_msg, {"role": "assistant", "content": mark}])
        first_b, _ = around("", [{"role": "user", "content": mark}])
        return cls({"system": sys_b, "user": usr_b, "assistant": as_b},
                   {"system": sys_e, "user": usr_e, "assistant": as_e}, first_b)


class ProgramState:
    def __init__(self, backend, roles: ChatRoles | None, text: str = "", variables: dict | None = None,
                 turns: int = 0):
        self.backend = backend
        self._roles = roles
        self._text = text
        self._vars: dict = dict(variables or {})
        self._meta: dict = {}
        self._turns = turns
        self._error: ProgramError | None = None
        self._queue: queue.Queue = queue.Queue()
        self._chunks: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="radixd-lang-state", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the program's side

    def __iadd__(self, other: object) -> ProgramState:
        expr = as_expr(other)
        with self._cond:
            self._pending += 1
        self._queue.put(expr)
        return self

    def __getitem__(self, name: str):
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no result named {name!r} in this program state")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_meta_info(self, name: str) -> dict:
        self.sync()
        return self._meta[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def sync(self) -> None:
        """Wait for everything queued so far; raise the first failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            raise self._error

    def fork(self, n: int) -> list[ProgramState]:
        """``n`` states continuing from this one's text and results, each running its calls
        in its own thread (concurrently with the others)."""
        if n < 1:
            raise ValueError("fork() needs n >= 1")
        self.sync()
        return [ProgramState(self.backend, self._roles, self._text, self._vars, self._turns) for _ in range(n)]

    def text_iter(self) -> Iterator[str]:
        """The text as it is produced (for ``run(..., stream=True)``), until the program ends."""
        while True:
            chunk = self._chunks.get()
            if chunk is _END:
                return
            yield chunk

    def close(self) -> None:
        self._queue.put(_END)

    # ------------------------------------------------------------------ the executor

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                self._chunks.put(_END)
                return
            try:
                if self._error is None:
                    self._run(expr)
            except ProgramError as exc:
                self._error = exc
            except Exception as exc:  # a back end's failure, named by the call that hit it
                self._error = ProgramError(f"{getattr(exc, 'call', 'a call')} failed: {exc}")
                self._error.__cause__ = exc
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _append(self, text: str) -> None:
        self._text += text
        if text:
            self._chunks.put(text)

    def _run(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._run(part)
        elif isinstance(expr, Role):
            self._role(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        else:
            raise ProgramError(f"cannot run {expr!r}")

    def _role(self, expr: Role) -> None:
        roles = self._roles
        if roles is None:
            raise ProgramError(f"{expr.role}(): this back end has no chat template")
        if expr.part != "end":
            first = self._turns == 0 and expr.role == "user"
            self._append(roles.first_user_begin if first else roles.begin[expr.role])
            self._turns += 1
        if expr.content is not None:
            self._run(expr.content)
        if expr.part != "begin":
            self._append(roles.end[expr.role])

    def _gen(self, expr: Gen) -> None:
        start = len(self._text)
        try:
            meta = self.backend.generate(self._text, expr.params, self._append)
        except Exception as exc:
            raise ProgramError(f"{expr.describe()} failed: {exc}") from exc
        if expr.name:
            self._vars[expr.name] = self._text[start:]
            self._meta[expr.name] = meta

    def _select(self, expr: Select) -> None:
        try:
            scored = self.backend.select(self._text, expr.choices)
        except Exception as exc:
            raise ProgramError(f"{expr.describe()} failed: {exc}") from exc
        best = max(range(len(scored)), key=lambda i: scored[i].normalized)  # first wins a tie
        self._append(scored[best].text)
        if expr.name:
            self._vars[expr.name] = scored[best].text
            self._meta[expr.name] = {"normalized_logprobs": [c.normalized for c in scored],
                                     "logprobs": [c.logprob for c in scored], "tokens": [c.tokens for c in scored]}
