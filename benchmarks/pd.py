"""Prefill/decode disaggregation under a mixed load: long prompts arriving while streams decode,
colocated (one instance) vs PD (a prefill and a decode instance), TTFT and inter-token latency.

    python3 -m benchmarks.pd --preset cpu   --out DIR   # default model, CPU: real daemons over HTTP,
                                                        # PD behind smg, KV over Mooncake TCP (~5 min)
    python3 -m benchmarks.pd --preset h200  --out DIR   # Llama-3-8B shape, random weights, one H200:
                                                        # two engines in one process sharing the GPU
    python3 -m benchmarks.pd --quick        --out DIR   # the in-process logic at toy size on CPU

The load: ``streams`` requests with short prompts decode ``stream_tokens`` tokens each; once
they all decode, ``long_prompts`` requests of ``long_len`` prompt tokens arrive one every
``gap_s`` seconds. Per configuration: the streams' inter-token latency (ITL) p50/p99, over
the whole run and while long prompts are being prefilled; the long prompts' and the
streams' TTFT p50/p99; and (PD) the KV transfers' rate. Colocated, every long prompt's
prefill chunks share steps with the streams' decodes (the ITL spikes); in PD they run on the
prefill instance and the decode instance only receives their KV.

* ``daemons`` (the cpu preset): one ``radixd`` daemon with all the cores against a prefill
  and a decode daemon with half each (``OMP_NUM_THREADS``), behind SGLang's gateway
  (``smg launch --pd-disaggregation``), the KV moved by the Mooncake transfer engine (TCP).
  Streams are ``/generate`` SSE streams; needs ``smg`` and Mooncake installed.
* ``inprocess`` (h200, --quick): one engine against two engines in one process sharing the
  device, the KV pool split between them (``kv_tokens`` / 2 each); the transfer is a direct
  device-to-device copy (``radixd.core.disagg.copy_kv``), no gateway, no transfer engine (the
  GPU machine has neither). The transfer rate is reported against the device's copy
  bandwidth (1 GiB ``copy_``, bytes read + written), measured in the same call. Both
  configurations must produce the same greedy tokens.

Writes DIR/pd.json and DIR/pd.log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    CPU_ENGINE,
    CUDA_ENGINE,
    SHAPES,
    Log,
    checkpoint_dir,
    cuda_median_s,
    environment,
    stop_process,
    write_json,
)

PRESETS = {
    # SmolLM2-135M on this machine's cores: 4 streams of 96 tokens, 6 prompts of 1024 tokens
    # one a second (each a few prefill chunks of 256)
    "cpu": dict(mode="daemons", model="default", streams=4, stream_len=32, stream_tokens=96, long_prompts=6,
                long_len=1024, long_out=4, gap_s=1.0, kv_tokens=16384, chunk=256, threads=os.cpu_count() or 2),
    # Llama-3-8B shape, bf16, one H200: 128 streams of 256 tokens, 16 prompts of 7936 tokens (the
    # shape's context is 8192)
    # four a second; 2 x 98k tokens of KV (12 GiB each) for PD, 196k for colocated
    "h200": dict(mode="inprocess", model="llama3-8b", streams=128, stream_len=128, stream_tokens=256, long_prompts=16,
                 long_len=7936, long_out=4, gap_s=0.25, kv_tokens=196608, chunk=8192, threads=0),
    # the in-process logic at toy size on CPU (to check the script, not to measure)
    "quick": dict(mode="inprocess", model="tiny", streams=3, stream_len=8, stream_tokens=24, long_prompts=2,
                  long_len=160, long_out=2, gap_s=0.05, kv_tokens=2048, chunk=64, threads=0),
}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(records: list[dict], windows: list[tuple[float, float]]) -> dict:
    """ITL of the streams (all gaps; gaps ending inside a long prompt's prefill window), TTFT."""
    streams = [r for r in records if r["kind"] == "stream"]
    longs = [r for r in records if r["kind"] == "long"]
    gaps, busy = [], []
    for r in streams:
        t = r["token_times"]
        for a, b in zip(t, t[1:], strict=False):
            gaps.append(b - a)
            if any(s <= b <= e for s, e in windows):
                busy.append(b - a)
    ms = lambda x: None if x is None else round(1e3 * x, 2)  # noqa: E731
    return {"itl_p50_ms": ms(pct(gaps, 0.5)), "itl_p99_ms": ms(pct(gaps, 0.99)),
            "itl_during_prefill_p50_ms": ms(pct(busy, 0.5)), "itl_during_prefill_p99_ms": ms(pct(busy, 0.99)),
            "long_ttft_p50_ms": ms(pct([r["ttft"] for r in longs], 0.5)),
            "long_ttft_p99_ms": ms(pct([r["ttft"] for r in longs], 0.99)),
            "stream_ttft_p50_ms": ms(pct([r["ttft"] for r in streams], 0.5)),
            "stream_ttft_p99_ms": ms(pct([r["ttft"] for r in streams], 0.99)),
            "itl_samples": len(gaps), "itl_samples_during_prefill": len(busy)}


def prompts(p: dict, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    one = lambda n: [rng.randrange(100, vocab - 1) for _ in range(n)]  # noqa: E731
    return [one(p["stream_len"]) for _ in range(p["streams"])], [one(p["long_len"]) for _ in range(p["long_prompts"])]


async def drive(p: dict, stream_ids, long_ids, one) -> tuple[list[dict], list[tuple[float, float]]]:
    """The load over ``one(kind, ids, max_new)`` (an async iterator of each token batch's
    arrival): streams first, then the long prompts once every stream decodes."""
    records: list[dict] = []
    windows: list[tuple[float, float]] = []
    decoding = asyncio.Event()
    started = 0

    async def run(kind: str, ids: list[int], max_new: int) -> None:
        nonlocal started
        t0 = time.perf_counter()
        times: list[float] = []
        tokens: list[int] = []
        async for toks in one(kind, ids, max_new):
            now = time.perf_counter()
            if kind == "stream" and not times:
                started += 1
                if started == p["streams"]:
                    decoding.set()
            times += [now] * len(toks)
            tokens += toks
        records.append({"kind": kind, "ttft": times[0] - t0 if times else None, "token_times": times,
                        "tokens": tokens, "prompt": len(ids)})
        if kind == "long":
            windows.append((t0, t0 + (times[0] - t0 if times else 0.0)))

    tasks = [asyncio.ensure_future(run("stream", ids, p["stream_tokens"])) for ids in stream_ids]
    await decoding.wait()
    for ids in long_ids:
        tasks.append(asyncio.ensure_future(run("long", ids, p["long_out"])))
        await asyncio.sleep(p["gap_s"])
    await asyncio.gather(*tasks)
    return records, windows


# ------------------------------------------------------------------ in-process (h200, --quick)


def engine_args(p: dict, tmp: Path) -> tuple[str, dict]:
    import torch

    cuda = p["model"] != "tiny" and torch.cuda.is_available()
    base = dict(CUDA_ENGINE if cuda else CPU_ENGINE, chunked_prefill_size=p["chunk"], max_prefill_tokens=p["chunk"])
    shape = dict(SHAPES["llama3-8b"])
    if p["model"] == "tiny":
        shape.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=4096, max_position_embeddings=2048)
    return checkpoint_dir(shape, where=tmp / p["model"]), {**base, "load_format": "dummy", "tokenizer": "none"}


async def inprocess(p: dict, tmp: Path, log: Log) -> dict:
    import torch

    from radixd import Engine, SamplingParams
    from radixd.core import disagg

    path, kw = engine_args(p, tmp)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    stream_ids, long_ids = prompts(p, vocab, seed=1)
    cuda = kw["device"] == "cuda"
    out: dict = {}
    if cuda:
        x = torch.empty(1024**3, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        out["copy_GBps"] = round(2 * x.numel() / cuda_median_s(lambda: y.copy_(x), reps=20) / 1e9, 1)
        del x, y

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    side = torch.cuda.Stream() if cuda else None

    async def measure(engines: list) -> tuple[list[dict], list[tuple[float, float]], list[tuple[int, float]]]:
        transfers: list[tuple[int, float]] = []

        async def alone(eng, ids, max_new):
            async for o in eng.generate(input_ids=ids, params=params(max_new)):
                if o.token_ids:
                    yield o.token_ids

        async def pd(kind, ids, max_new):
            prefill, decode = engines
            async for _ in prefill.generate(input_ids=ids, params=params(1)):
                pass
            held = disagg.hold(prefill, ids)
            res = disagg.reserve(decode, len(ids))
            assert held is not None and res is not None, "no KV room: raise kv_tokens"
            (node, src), (key, dst) = held, res
            if cuda:  # (on a stream of its own, timed by its events: the engines' steps run meanwhile)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    start.record()
                    moved = disagg.copy_kv(prefill, src, decode, dst)
                    end.record()
                end.synchronize()
                transfers.append((moved, start.elapsed_time(end) / 1e3))
            else:
                t0 = time.perf_counter()
                moved = disagg.copy_kv(prefill, src, decode, dst)
                transfers.append((moved, time.perf_counter() - t0))
            disagg.let_go(prefill, node)
            disagg.received(decode, key, ids)
            async for toks in alone(decode, ids, max_new):
                yield toks

        for e in engines:
            await e.start()
        try:
            one = pd if len(engines) == 2 else (lambda kind, ids, n: alone(engines[0], ids, n))
            records, windows = await drive(p, stream_ids, long_ids, one)
            for e in engines:
                e.check_accounting()
        finally:
            for e in engines:
                await e.stop()
        return records, windows, transfers

    tokens: dict[str, list] = {}
    for config in ("colocated", "pd"):
        n = 1 if config == "colocated" else 2  # PD: the pool split between the two
        records, windows, transfers = await measure(
            [Engine(model=path, kv_cache_tokens=p["kv_tokens"] // n, **kw) for _ in range(n)])
        if cuda:
            torch.cuda.empty_cache()
        res = summary(records, windows)
        if transfers:
            b, t = sum(x for x, _ in transfers), sum(t for _, t in transfers)
            res["transfer_GB"] = round(b / 1e9, 3)
            res["transfer_GBps"] = round(b / t / 1e9, 2)
            if "copy_GBps" in out:
                res["transfer_of_copy_bandwidth"] = round(b / t / 1e9 / out["copy_GBps"], 3)
        tokens[config] = sorted(tuple(r["tokens"]) for r in records)
        out[config] = res
        log(config, json.dumps(res))
    out["same_tokens"] = tokens["colocated"] == tokens["pd"]
    return out


# ------------------------------------------------------------------ daemons (cpu)


class Proc:
    """A subprocess with its log file; ``radixd`` ones wait for their "listening" line."""

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None, radixd: bool = False):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.port = None
        deadline = time.monotonic() + 600
        while radixd and self.port is None:
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"listening"' in line:
                    self.port = json.loads(line)["port"]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv} did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon(tmp: Path, name: str, p: dict, mode: str, kv: int, threads: int, bootstrap: int) -> Proc:
    (tmp / name).mkdir(parents=True)
    cfg = tmp / name / "radixd.toml"
    cfg.write_text(f"""
[model]
path = "{p['model']}"
[server]
port = 0
watchdog = false
[memory]
kv_cache_tokens = {kv}
[scheduler]
chunked_prefill_size = {p['chunk']}
max_prefill_tokens = {p['chunk']}
[disaggregation]
mode = "{mode}"
bootstrap_port = {bootstrap}
""")
    return Proc([sys.executable, "-m", "radixd", "--config", str(cfg)], tmp / name / "radixd.log",
                env={"OMP_NUM_THREADS": str(threads)}, radixd=True)


async def daemons(p: dict, tmp: Path, log: Log) -> dict:
    import httpx

    if shutil.which("smg") is None:
        raise SystemExit("the cpu preset needs SGLang's gateway: pip install smg")
    from radixd.core.model_loader import resolve_model

    vocab = json.loads((Path(resolve_model(p["model"], progress=False)) / "config.json").read_text())["vocab_size"]
    stream_ids, long_ids = prompts(p, vocab, seed=1)
    out: dict = {}
    tokens: dict[str, list] = {}
    for config in ("colocated", "pd"):
        procs: list[Proc] = []
        try:
            if config == "colocated":
                procs.append(daemon(tmp / config, "colocated", p, "off", p["kv_tokens"], p["threads"], free_port()))
                url = f"http://127.0.0.1:{procs[0].port}"
            else:
                boot = free_port()
                half = max(1, p["threads"] // 2)
                procs.append(daemon(tmp / config, "prefill", p, "prefill", p["kv_tokens"] // 2, half, boot))
                procs.append(daemon(tmp / config, "decode", p, "decode", p["kv_tokens"] // 2, half, boot))
                port = free_port()
                procs.append(Proc(["smg", "launch", "--pd-disaggregation", "--backend", "sglang",
                                   "--prefill", f"http://127.0.0.1:{procs[0].port}", str(boot),
                                   "--decode", f"http://127.0.0.1:{procs[1].port}", "--host", "127.0.0.1",
                                   "--port", str(port)], tmp / config / "smg.log"))
                url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, timeout=600) as c:
                deadline = time.monotonic() + 120
                while True:  # ready (smg: once it has registered both workers)
                    try:
                        r = await c.post("/generate", json={"input_ids": [100, 101], "sampling_params": {
                            "max_new_tokens": 1}})
                        if r.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{config}: not ready")
                    await asyncio.sleep(0.5)

                async def one(kind, ids, max_new):
                    body = {"input_ids": ids, "stream": True, "sampling_params": {
                        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
                    seen = 0
                    async with c.stream("POST", "/generate", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ids_so_far = json.loads(line[6:])["output_ids"]
                                if len(ids_so_far) > seen:
                                    yield ids_so_far[seen:]
                                    seen = len(ids_so_far)

                records, windows = await drive(p, stream_ids, long_ids, one)
        finally:
            for pr in reversed(procs):
                pr.stop()
        res = summary(records, windows)
        out[config] = res
        tokens[config] = sorted(tuple(r["tokens"]) for r in records)
        log(config, json.dumps(res))
    out["same_tokens"] = tokens["colocated"] == tokens["pd"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--quick", action="store_true", help="the quick preset: the in-process logic at toy size, CPU")
    ap.add_argument("--out", required=True, type=Path)
    for key in ("streams", "stream_tokens", "long_prompts", "long_len", "kv_tokens", "threads"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    ap.add_argument("--gap-s", type=float, default=None)
    args = ap.parse_args()
    preset = "quick" if args.quick else args.preset
    p = dict(PRESETS[preset])
    for key in p:
        if getattr(args, key, None) is not None:
            p[key] = getattr(args, key)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "pd.log")
    log("preset", preset, json.dumps(p))
    with tempfile.TemporaryDirectory(prefix="radixd-pd-") as tmp:
        run = inprocess if p["mode"] == "inprocess" else daemons
        result = asyncio.run(run(p, Path(tmp), log))
    doc = {"benchmark": "pd", "preset": preset, "params": p, **result, "environment": environment()}
    write_json(args.out / "pd.json", doc)
    log("wrote", args.out / "pd.json")
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
