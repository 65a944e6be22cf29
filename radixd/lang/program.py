"""``@function`` programs: ``.run(**args)``, ``.run_batch([...], num_threads)``, streaming."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from radixd.lang.state import ChatRoles, ProgramState


class Program:
    def __init__(self, fn: Callable, backend=None):
        self.fn = fn
        self.backend = backend
        self._roles: dict[int, ChatRoles | None] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def bind(self, backend) -> Program:
        """The same program with a default back end."""
        return Program(self.fn, backend)

    def _roles_for(self, backend) -> ChatRoles | None:
        with self._lock:
            key = id(backend)
            if key not in self._roles:
                try:
                    self._roles[key] = ChatRoles.probe(backend)
                except Exception:  # no chat template: plain-text programs still run
                    self._roles[key] = None
            return self._roles[key]

    def _backend(self, backend):
        backend = backend or self.backend
        if backend is None:
            raise ValueError("no back end: pass backend=RuntimeEndpoint(url) or EngineRuntime(...), or use .bind()")
        return backend

    def run(self, *args, backend=None, stream: bool = False, **kwargs) -> ProgramState:
        """Run the program; returns its state once every call is done (``stream=True``:
        at once, with ``state.text_iter()`` yielding the text as it comes)."""
        backend = self._backend(backend)
        s = ProgramState(backend, self._roles_for(backend))
        if stream:
            def body():
                try:
                    self.fn(s, *args, **kwargs)
                finally:
                    s.close()
            threading.Thread(target=body, name="radixd-lang-program", daemon=True).start()
            return s
        try:
            self.fn(s, *args, **kwargs)
            s.sync()
        finally:
            s.close()
        return s

    def run_batch(self, batch: list[dict], *, backend=None, num_threads: int = 16,
                  raise_errors: bool = True) -> list[ProgramState | Exception]:
        """Run the program once per argument dict, ``num_threads`` at a time; results in
        order (an ``Exception`` in place of a failed run when ``raise_errors`` is False)."""
        backend = self._backend(backend)
        self._roles_for(backend)

        def one(kw: dict):
            try:
                return self.run(backend=backend, **kw)
            except Exception as exc:
                if raise_errors:
                    raise
                return exc

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            return list(pool.map(one, batch))

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def function(fn: Callable) -> Program:
    """Make ``fn(s, **args)`` a program: ``fn.run(**args, backend=...)``."""
    return Program(fn)
