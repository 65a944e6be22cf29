"""SGLang's own load generator, ``python -m sglang.bench_serving``, unmodified, against a real
daemon: the ``sglang`` (native ``/generate``), ``sglang-oai`` and ``vllm`` (``/v1/completions``)
and ``sglang-oai-chat`` (``/v1/chat/completions``) backends, each streamed, each once in a burst
without a concurrency bound and once paced (Poisson arrivals, seeded) over more than 30 s with
``--max-concurrency``: every request must complete.

The eight runs go at once against one daemon (they are clients, mostly waiting); the frontend
is the ``sglang`` wheel of the test extras (its ``bench_serving`` module needs only it,
transformers and aiohttp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import Daemon
from test_daemon_lifecycle import toml

pytest.importorskip("sglang.bench_serving", reason="SGLang's frontend is not installed (test extras)")

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat", "vllm")
BURST = 8                    # prompts of a burst run
PACED = 14                   # prompts of a paced run, at PACED_RATE a second on average:
PACED_RATE = 0.5             # seed 1 draws 36.5 s of waits between them (the run lasts at least
                             # that: it sleeps each wait, the last one's too), past 30 s
# it looks the served model's name up on the hub for its config first (a warning when absent)
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def daemon(tiny_models, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("bench-serving"),
               toml(tiny_models["llama"], scheduler={"max_running_requests": 16},
                    # random ids decode to text that spells special tokens, which chat
                    # messages may not by default (refused: a prompt-injection guard)
                    limits={"max_queued_requests": 256, "chat_special_tokens": "as_text"}))
    yield d
    d.stop()


def bench_command(daemon, tokenizer, backend: str, out, *, paced: bool) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", daemon.url,
           "--dataset-name", "random-ids", "--tokenizer", str(tokenizer), "--random-input-len", "48",
           "--random-output-len", "24", "--random-range-ratio", "0.5", "--seed", "1", "--disable-tqdm",
           "--warmup-requests", "1", "--output-file", str(out), "--output-details"]
    if paced:
        return cmd + ["--num-prompts", str(PACED), "--request-rate", str(PACED_RATE), "--max-concurrency", "2"]
    return cmd + ["--num-prompts", str(BURST)]


def test_bench_serving_backends_complete_every_request(daemon, tiny_models, tmp_path):
    runs = {}
    for backend in BACKENDS:
        for paced in (False, True):
            out = tmp_path / f"{backend}-{'paced' if paced else 'burst'}.jsonl"
            log = open(tmp_path / f"{out.stem}.log", "w")
            runs[out] = (subprocess.Popen(bench_command(daemon, tiny_models["llama"], backend, out, paced=paced),
                                          stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=OFFLINE), log, paced)
    results = {}
    for out, (proc, log, paced) in runs.items():
        try:
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = (tmp_path / f"{out.stem}.log").read_text()
        assert proc.returncode == 0 and out.exists(), f"{out.stem}:\n{text[-3000:]}"
        results[out.stem] = (json.loads(out.read_text().splitlines()[-1]), paced)
    completed = {name: result["completed"] for name, (result, _) in results.items()}
    assert completed == {name: PACED if paced else BURST for name, (_, paced) in results.items()}, {
        name: [e for e in result["errors"] if e][:3] for name, (result, _) in results.items()}
    assert all(result["total_output_tokens"] > 0 for result, _ in results.values())
    durations = {name: round(result["duration"], 1) for name, (result, paced) in results.items() if paced}
    assert min(durations.values()) > 30, durations
