"""``LimitedPool``: run a function in a worker process under a wall-time limit and a memory
limit, for work that a hostile input can make explode (a grammar whose automaton blows up).

    parent                                   worker process (spawned: no inherited threads)
    run(fn, *args) --(fn, args) pipe------>  RLIMIT_AS = its size after start-up + memory_bytes
       waits <= timeout_s                    result | exception | MemoryError
       late: kill the worker, start another  ---(kind, value) pipe---> run returns or raises

A thread cannot be stopped and shares the daemon's memory; a process can be killed, and the
kernel refuses it memory past its limit (Python raises ``MemoryError``). ``fn`` and its
arguments must pickle (a module-level function); ``initializer(*initargs)`` runs once in each
worker, and what it returns is passed to ``fn`` as its first argument (e.g. a tokenizer).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import resource
import threading
from collections.abc import Callable
from typing import Any


class LimitExceeded(Exception):
    """The call ran past its time limit (``kind = "time"``), its memory limit (``"memory"``),
    or its worker died (``"crashed"``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(conn, memory_bytes: int, initializer, initargs) -> None:
    context = initializer(*initargs) if initializer is not None else None
    if memory_bytes:
        limit = _vm_size() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            result = fn(context, *args) if initializer is not None else fn(*args)
            reply = ("ok", result)
        except MemoryError:
            reply = ("memory", None)
        except Exception as exc:  # sent back as an exception if it pickles, else as text
            reply = ("error", exc)
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
        except MemoryError:
            conn.send(("memory", None))


class _Worker:
    def __init__(self, ctx, memory_bytes: int, initializer, initargs):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, memory_bytes, initializer, initargs), daemon=True,
                                   name="radixd-limited")
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class LimitedPool:
    """Up to ``workers`` worker processes, started on first use; see the module docstring."""

    def __init__(self, workers: int = 1, *, timeout_s: float, memory_bytes: int = 0,
                 initializer: Callable | None = None, initargs: tuple = ()):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._initializer = initializer
        self._initargs = initargs
        self._ctx = multiprocessing.get_context("spawn")
        self._size = workers
        self._idle: list[_Worker] = []
        self._started = 0
        self._lock = threading.Lock()
        self._free = threading.Semaphore(workers)
        self.killed = {"time": 0, "memory": 0, "crashed": 0}
        self.startup_s = 120.0

    def _take(self) -> _Worker:
        self._free.acquire()
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self._started += 1
        return _Worker(self._ctx, self.memory_bytes, self._initializer, self._initargs)

    def _give(self, worker: _Worker | None) -> None:
        with self._lock:
            if worker is not None:
                self._idle.append(worker)
        self._free.release()

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` (with the initializer's value first, if there is one) in a worker,
        blocking; raises ``LimitExceeded`` or what ``fn`` raised."""
        worker = self._take()
        keep: _Worker | None = worker
        try:
            if not worker.ready:  # its start-up (imports, initializer) is not the call's time
                self._reply(worker, self.startup_s, "start-up")
                worker.ready = True
            worker.conn.send((fn, args))
            kind, value = self._reply(worker, self.timeout_s, "call")
            if kind == "memory":
                # its heap may be fragmented near the limit: start afresh
                keep = None
                worker.kill()
                self.killed["memory"] += 1
                raise LimitExceeded("memory", f"needed more than {self.memory_bytes // 2**20} MiB")
            if kind == "error":
                raise value
            return value
        except LimitExceeded as exc:
            if exc.kind != "memory":
                keep = None
            raise
        finally:
            self._give(keep)

    def _reply(self, worker: _Worker, timeout: float, what: str) -> tuple[str, Any]:
        if not worker.conn.poll(timeout):
            worker.kill()
            self.killed["time"] += 1
            raise LimitExceeded("time", f"took longer than {timeout:g} s" + (" to start" if what == "start-up" else ""))
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            worker.kill()
            self.killed["crashed"] += 1
            raise LimitExceeded("crashed", f"the worker process died (exit code {worker.process.exitcode})") from None

    async def run(self, fn: Callable, *args: Any) -> Any:
        """``call`` off the event loop."""
        return await asyncio.to_thread(self.call, fn, *args)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
