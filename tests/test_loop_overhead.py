"""bench/loop_overhead.py (the batching loop's CPU per decode step, forward pass stubbed)
runs end to end at a small size and reports consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_loop_overhead_bench_runs(tmp_path):
    script = Path(__file__).resolve().parent.parent / "bench" / "loop_overhead.py"
    r = subprocess.run([sys.executable, str(script), "--requests", "8", "--new-tokens", "12", "--repeats", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "loop_overhead.json").read_text())["results"]
    assert [(x["tokenizer"], x["requests"]) for x in res] == [(False, 8), (True, 8)]
    for x in res:
        assert x["output_tokens"] == 8 * 12  # the stub's picks reached every consumer
        assert x["decode_steps_timed"] >= 8  # one prefill step, then every request decodes
        assert x["us_per_step_median"] > 0
        # (the figures are rounded to 0.1 and 0.01 us: they may differ by 0.05 / 8 + 0.005)
        assert abs(x["us_per_request_step_median"] - x["us_per_step_median"] / 8) < 0.012
        assert "_build" in x["profile_tottime"] or "_build" in x["profile_cumulative"]
    assert (tmp_path / "log.txt").read_text().count("us/request-step") == 2
