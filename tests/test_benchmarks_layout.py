"""The benchmarks stay usable as documented: every result file BENCHMARKS.md and
docs/benchmarks/ cite exists (in the tree, or in git for the earlier runs they name), every
``benchmarks.<script>`` they name is a module, and no script edits ``sys.path``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
# the last commit with the old layout: the earlier runs the docs name as bench/results/...
HISTORY = "3369c7d"


def _cited(prefix: str) -> set[str]:
    found = set()
    for doc in DOCS:
        for m in re.finditer(re.escape(prefix) + r"[A-Za-z0-9_./-]*", doc.read_text()):
            path = m.group(0).rstrip(".").rstrip("/")
            if path != prefix.rstrip("/") and not path.endswith(".."):
                found.add(path)
    return found


def test_benchmarks_md_opens_with_the_headline_table():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| figure |"))
    assert head < 10
    assert lines[head].split("|")[1:7] == [" figure ", " value ", " peer or limit, same run ", " hardware ",
                                           " commit ", " command "]


def test_cited_results_exist():
    cited = _cited("benchmarks/results/")
    assert cited
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, missing


def test_cited_earlier_runs_are_in_git():
    if shutil.which("git") is None or subprocess.run(["git", "cat-file", "-e", f"{HISTORY}^{{commit}}"], cwd=ROOT,
                                                       capture_output=True).returncode != 0:
        pytest.skip(f"no git history with {HISTORY} here")
    missing = [p for p in sorted(_cited("bench/results/"))
               if subprocess.run(["git", "cat-file", "-e", f"{HISTORY}:{p}"], cwd=ROOT,
                                 capture_output=True).returncode != 0]
    assert not missing, missing


def test_named_scripts_are_modules():
    names = set()
    for doc in [*DOCS, ROOT / "README.md", ROOT / "benchmarks" / "gpu_all.sh"]:
        names |= set(re.findall(r"(?<![\w/])benchmarks\.([a-z0-9_]+)", doc.read_text()))
    assert {"gpu_bench", "multi_gpu_bench", "loop_overhead"} <= names
    assert not [n for n in sorted(names) if not (ROOT / "benchmarks" / f"{n}.py").is_file()]


def test_no_script_edits_sys_path():
    offenders = [p.name for p in (ROOT / "benchmarks").glob("*.py") if "sys.path" in p.read_text()]
    assert not offenders, offenders
