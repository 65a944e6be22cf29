"""CPU defaults: what dtype "auto" picks on a CPU, and torch's threads from the allowed cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from radixd.core import cpu_setup
from radixd.core.assembly import pick_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_where_the_cpu_has_it(monkeypatch, native):
    monkeypatch.delenv(cpu_setup.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(cpu_setup, "native_bf16", lambda: native)
    assert pick_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    assert pick_dtype("float32", CPU) == torch.float32


def test_the_environment_replaces_the_probe(monkeypatch):
    monkeypatch.setattr(cpu_setup, "native_bf16", lambda: True)
    monkeypatch.setenv(cpu_setup.AUTO_DTYPE_ENV, "float32")
    assert pick_dtype("auto", CPU) == torch.float32
    monkeypatch.setenv(cpu_setup.AUTO_DTYPE_ENV, "half")
    with pytest.raises(ValueError, match="RADIXD_CPU_AUTO_DTYPE='half'"):
        pick_dtype("auto", CPU)


def test_threads_follow_the_affinity_mask_unless_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {0}, raising=False)
        assert cpu_setup.set_threads() == 1 == torch.get_num_threads()
        # a core is left for the event loop, tokenizers and whatever else shares the machine
        monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
        assert cpu_setup.set_threads() == 3 == torch.get_num_threads()
        monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        assert cpu_setup.set_threads() == 1 == torch.get_num_threads()
        monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu_setup.set_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_kernel_threads_take_a_second_core_where_allowed(monkeypatch):
    monkeypatch.delenv(cpu_setup.KERNEL_THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu_setup.kernel_threads() == 2
    monkeypatch.setenv(cpu_setup.KERNEL_THREADS_ENV, "1")
    assert cpu_setup.kernel_threads() == 1
    monkeypatch.setenv(cpu_setup.KERNEL_THREADS_ENV, "2")
    assert cpu_setup.kernel_threads() == 2
    monkeypatch.setattr(cpu_setup.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert cpu_setup.kernel_threads() == 1  # (one core allowed)
    monkeypatch.delenv(cpu_setup.KERNEL_THREADS_ENV)
    assert cpu_setup.kernel_threads() == 1
    monkeypatch.setenv(cpu_setup.KERNEL_THREADS_ENV, "two")
    with pytest.raises(ValueError, match="RADIXD_CPU_KERNEL_THREADS='two'"):
        cpu_setup.kernel_threads()


@pytest.mark.parametrize("preset,want", [({}, "1000"), ({"GOMP_SPINCOUNT": "50"}, "50"),
                                         ({"OMP_WAIT_POLICY": "ACTIVE"}, "unset")])
def test_importing_radixd_first_bounds_the_openmp_spin(preset, want):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", "import os, radixd; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"],
                         env={**env, **preset}, capture_output=True, text=True, check=True).stdout.strip()
    assert out == want
