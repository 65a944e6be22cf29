"""CPU cost of the batching loop per decode step, with the forward pass taken out.

An in-process ``Engine`` on CPU (random weights of a tiny Llama shape, ``load_format="dummy"``)
whose worker's ``launch``/``resolve`` are replaced by a stub that returns at once with valid
picks: what is left is the event loop's own work per step (scheduling, batch and tensor
construction, processing the picks, detokenizing, streaming to the consumers, releasing)
plus the two hand-overs to the worker thread. N requests (a shared 64-token prompt prefix
plus a distinct tail) all decode M tokens; each is consumed by its own task iterating
``Engine.generate``, as a front end would.

Reported per configuration (N running requests, tokenizer none / a byte-level BPE):
CPU microseconds of the event loop's thread per decode step and per request-step (median
over the steps in which every request decodes one token; thread CPU time, so other load on
the machine and the worker thread's hand-over are left out), the process CPU time of the
whole run per output token, and the top functions of a cProfile run of the decode phase
(timed by the thread's CPU clock).

    python -m benchmarks.loop_overhead --out DIR   # writes DIR/loop_overhead.json + DIR/log.txt
    python -m benchmarks.loop_overhead --requests 64 256 --new-tokens 64 --no-profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    CPU_ENGINE,
    Log,
    builtin_plugins,
    checkpoint_dir,
    environment,
    write_json,
)
from radixd import Engine, SamplingParams
from radixd.core.forward_batch import StepOutput

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
             tie_word_embeddings=False)


def checkpoint(tokenizer: bool) -> str:
    """A config-only checkpoint directory (weights are random: ``load_format="dummy"``), with a
    small trained byte-level BPE tokenizer when ``tokenizer``."""
    d = Path(tempfile.mkdtemp(prefix="radixd-loop-"))
    vocab = 512
    if tokenizer:
        tok = _train_tokenizer(vocab)
        tok.save_pretrained(d)
        vocab = len(tok)
    return checkpoint_dir(dict(SHAPE, vocab_size=vocab), where=d)


def _train_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = "the capital of france is paris hello world radix attention serving tokens batch".split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


class StubWorker:
    """Stands in for the worker's ``launch``/``resolve``: no forward pass, instant picks
    (deterministic, never an EOS id, in the model's vocabulary)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.calls = 0

    def launch(self, batch, prev=None):
        self.calls += 1
        n = len(batch.sample_indices)
        base = self.calls * 7
        return [2 + (base + 13 * i) % (self.vocab - 2) for i in range(n)]

    @staticmethod
    def resolve(picks):
        return StepOutput(next_tokens=picks if picks is not None else [])


async def run_once(path: str, tokenizer: bool, n: int, new: int, profile: bool) -> dict:
    eng = Engine(model=path, tokenizer=None if tokenizer else "none", load_format="dummy", **CPU_ENGINE,
                 plugin_manager=builtin_plugins(),
                 max_running_requests=n, max_prefill_tokens=1 << 20, chunked_prefill_size=1 << 20,
                 kv_cache_tokens=n * (96 + new) + 1024)
    stub = StubWorker(eng.model_cfg.vocab_size)
    rep = eng.replicas[0]
    rep.worker.launch = stub.launch
    rep.worker.resolve = stub.resolve
    # (CPU s of the loop's thread, wall s, batch tokens, batch size) at the end of each step
    marks: list[tuple[float, float, int, int]] = []

    prof = cProfile.Profile(time.thread_time) if profile else None  # CPU time: the machine may be shared
    profiling = False

    def hook(step):
        nonlocal profiling
        marks.append((time.thread_time(), time.perf_counter(), step.batch.num_tokens, step.batch.batch_size))
        if prof is not None and not profiling and step.batch.num_tokens == n == step.batch.batch_size:
            profiling = True  # profile the decode phase only
            prof.enable()

    eng.step_hook = hook
    prefix = [2 + (7 * i) % 200 for i in range(64)]
    prompts = [prefix + [2 + (i * 31 + j) % 200 for j in range(16)] for i in range(n)]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    tokens = 0

    async def consume(ids):
        nonlocal tokens
        async for out in eng.generate(input_ids=ids, params=params):
            tokens += len(out.token_ids)

    async with eng:
        await consume(prompts[0])  # warm-up (and the prefix into the cache)
        marks.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(consume(p) for p in prompts))
        if prof is not None:
            prof.disable()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    # a full decode step: every request decodes one token (the batch has n tokens, n requests)
    per_step = [(b[0] - a[0]) * 1e6 for a, b in zip(marks, marks[1:], strict=False)
                if b[2] == n and b[3] == n and a[3] == n]
    med = statistics.median(per_step) if per_step else float("nan")
    # the 10th percentile: steps a busy machine interfered with least
    p10 = statistics.quantiles(per_step, n=10)[0] if len(per_step) >= 10 else float("nan")
    res = {"requests": n, "new_tokens": new, "tokenizer": tokenizer, "steps": len(marks),
           "decode_steps_timed": len(per_step), "output_tokens": tokens - new,
           "cpu_s": round(cpu, 4), "wall_s": round(wall, 4),
           "us_per_step_median": round(med, 1), "us_per_request_step_median": round(med / n, 2),
           "us_per_step_p10": round(p10, 1), "us_per_request_step_p10": round(p10 / n, 2),
           "us_per_output_token_overall": round(cpu * 1e6 / max(1, tokens - new), 2)}
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        res["profile_tottime"] = s.getvalue()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        res["profile_cumulative"] = s.getvalue()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    ap.add_argument("--tokenizer", choices=["none", "bpe", "both"], default="both")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="directory for loop_overhead.json and log.txt")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.txt").write_text("")
    log = Log(out / "log.txt" if out else None)

    results = []
    toks = {"none": [False], "bpe": [True], "both": [False, True]}[args.tokenizer]
    for tok in toks:
        path = checkpoint(tok)
        for n in args.requests:
            runs = [asyncio.run(run_once(path, tok, n, args.new_tokens, False)) for _ in range(args.repeats)]
            runs.sort(key=lambda r: r["us_per_step_median"])
            best = runs[len(runs) // 2]
            best["all_us_per_step_median"] = [r["us_per_step_median"] for r in runs]
            best["all_us_per_step_p10"] = [r["us_per_step_p10"] for r in runs]
            log(f"tokenizer={'bpe' if tok else 'none'} N={n} M={args.new_tokens}: "
                f"{best['us_per_step_median']:.0f} us/step, {best['us_per_request_step_median']:.1f} us/request-step "
                f"(runs {best['all_us_per_step_median']}; p10 {best['all_us_per_step_p10']}); overall {best['us_per_output_token_overall']:.1f} us "
                f"CPU/output token, {best['decode_steps_timed']} decode steps timed")
            if not args.no_profile:
                prof = asyncio.run(run_once(path, tok, n, args.new_tokens, True))
                best["profile_tottime"] = prof["profile_tottime"]
                best["profile_cumulative"] = prof["profile_cumulative"]
                log(prof["profile_tottime"])
            results.append(best)
    if out:
        write_json(out / "loop_overhead.json", {"environment": environment(), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
