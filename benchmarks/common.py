"""What the benchmark scripts share: model shapes with random weights, engine-free functions for
timing, logging and result files, and the record of where a figure was measured.

Contract: every script of ``benchmarks/`` runs from the repository root as
``python -m benchmarks.<script>``, imports its siblings as ``benchmarks.<module>`` and writes
its results through these functions, so that each JSON file carries the same ``environment()``
record (machine, software, commit, command). Nothing here builds an ``Engine``: how each
benchmark configures one is part of what it measures and stays in its script.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Real model shapes (weights come from ``load_format="dummy"``: random, nothing downloaded).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
}
# What every config-only Llama checkpoint adds to its shape.
LLAMA = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, eos_token_id=0)
# Engine settings the scripts share. CPU: float32 on the reference torch attention backend, no
# CUDA graphs (the loop benchmarks, and smoke runs of the GPU scripts' logic). CUDA: bf16 with
# the serving batch limits the GPU figures were measured at, and no prompt budget beside decodes
# (nor mixed graphs): a batch's prompts are all prefilled before its decode window opens, which
# the one-GPU default (512 prompt tokens a step beside decodes) would stretch over many steps
# while the first requests already decode, so a batch would never decode whole.
CPU_ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", attention_backend="torch", cuda_graphs=False)
CUDA_ENGINE: dict[str, Any] = dict(device="cuda", dtype="bfloat16", max_running_requests=256,
                                   max_prefill_tokens=16384, chunked_prefill_size=8192,
                                   mixed_prefill_tokens=16384, mixed_cuda_graphs=False)


def checkpoint_dir(shape: dict[str, Any], *, prefix: str = "radixd-", where: Path | None = None) -> str:
    """A config-only Llama checkpoint of ``shape`` (random weights: ``load_format="dummy"``),
    in a new temporary directory or in ``where``."""
    if where is None:
        d = Path(tempfile.mkdtemp(prefix=prefix))
    else:
        d = where
        d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**shape, **LLAMA}))
    return str(d)


def builtin_plugins(**kw: Any):
    """A plugin manager with radixd's built-in plugins only, so that the figures are radixd's
    own whatever else is installed (``kw``: e.g. ``extra=[module]``)."""
    from radixd.plugins import make_plugin_manager

    return make_plugin_manager(load_entry_points=False, **kw)


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> int:
    """Terminate ``proc`` (a server the benchmark started), kill it after ``timeout`` s; its code."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


def free() -> None:
    """Give back device memory of engines the caller has dropped (set to None)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cuda_median_s(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median device time of ``fn()`` in seconds, from CUDA events around each call."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def cuda_device_s(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median device time of ``fn()`` in seconds with its launches queued behind a busy
    device (a sleep kernel before the first event), so that the host's cost of issuing them,
    hidden in serving by the steps before, is not timed as device time."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # (about a millisecond: longer than issuing fn's launches)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def time_graph(fn: Callable[[], object], reps: int = 30) -> float:
    """Median device seconds of ``fn`` captured in a CUDA graph (launch gaps as in serving)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_median_s(g.replay, reps=reps)



async def generate_all(engine, prompts: list[list[int]], new: int) -> dict:
    """Greedy ``new`` tokens for every prompt at once (EOS ignored): the start, the time the
    last request got its first token, and the time the last one ended (perf_counter)."""
    from radixd import SamplingParams

    t0 = time.perf_counter()
    firsts, ends = [], []

    async def one(p):
        first = None
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        async for out in engine.generate(input_ids=p, params=params):
            if first is None and out.token_ids:
                first = time.perf_counter()
        firsts.append(first)
        ends.append(time.perf_counter())

    await asyncio.gather(*(one(p) for p in prompts))
    return {"t0": t0, "all_first": max(firsts), "end": max(ends)}

def timed_section(fn: Callable[[], dict]) -> dict:
    """``fn()``'s result with its wall time as ``section_s``; a section that raises reports
    ``{"error": ...}`` (traceback on stderr) so the sections after it still run."""
    t = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # noqa: BLE001 (reported in the result, the run goes on)
        traceback.print_exc()
        res = {"error": repr(exc)}
    res["section_s"] = round(time.perf_counter() - t, 1)
    return res


class Log:
    """Lines printed and appended to a file as they come (the file survives a killed run)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.lines: list[str] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")


def write_json(path: Path | str, doc: Any, indent: int = 1) -> Path:
    """Write ``doc`` as JSON to ``path`` (its directory created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Where and with what a figure was measured: the command, the commit (and whether
    ``radixd/`` had uncommitted changes), Python, torch, CPU, GPUs, the load average."""
    import torch

    import radixd

    info: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.orig_argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "git_commit": _git("rev-parse", "HEAD"),
        "radixd_tree_dirty": bool(_git("status", "--porcelain", "--", "radixd")),
        "radixd": radixd.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


class RedisServer:
    """A throwaway ``redis-server`` (``exe``) on a free loopback port, no persistence;
    ``maxmemory`` set: an LRU cache of that size. ``kill()`` ends it (idempotent)."""

    def __init__(self, exe: str, workdir: Path, maxmemory: str | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        limits = ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"] if maxmemory else []
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir), *limits],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
