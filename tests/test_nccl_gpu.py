"""NCCL in one process (``radixd.core.nccl``): two shard threads all-reduce on two GPUs.
Runs on a machine with two CUDA devices (``-m gpu``)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_all_reduce_between_two_threads():
    from radixd.core.nccl import Nccl

    nccl = Nccl()
    uid = nccl.unique_id()

    def rank(r: int):
        torch.cuda.set_device(r)
        comm = nccl.init_rank(2, uid, r)
        outs = []
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.full((1000,), float(r + 1), device=f"cuda:{r}", dtype=dtype)
            comm.all_reduce(t)
            torch.cuda.synchronize(r)
            outs.append(t.float().cpu())
        comm.close()
        return outs

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(rank, range(2)))
    for outs in results:
        for t in outs:
            assert torch.equal(t, torch.full((1000,), 3.0))
