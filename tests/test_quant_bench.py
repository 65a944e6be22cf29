"""benchmarks/quant.py in its --quick CPU mode: every scheme's model is built quantized, decodes
and prefills, and the JSON carries each figure, its roofline and the speed-ups over bf16."""

from __future__ import annotations

import json

from benchmarks import quant


def test_quant_benchmark_quick(tmp_path):
    out = tmp_path / "quant.json"
    assert quant.main(["--json", str(out), "--quick"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["schemes"]) == {"bf16", "fp8-channel", "fp8-block", "int4-g128"}
    for name, res in doc["schemes"].items():
        assert [c["batch"] for c in res["decode"]] == [1, 2], name
        assert all(c["decode_tok_s"] > 0 and 0 < c["roofline_fraction"] for c in res["decode"])
        assert res["prefill"]["tok_s"] > 0
    w = {n: r["weights_read_per_step_GB"] for n, r in doc["schemes"].items()}
    # (float32 on the CPU: the projections' fp8 a quarter of it, int4 an eighth, plus scales)
    assert w["int4-g128"] < w["fp8-channel"] < w["fp8-block"] * 1.01 < w["bf16"]
    assert set(doc["speedup_over_bf16"]) == {"fp8-channel", "fp8-block", "int4-g128"}
