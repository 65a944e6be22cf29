"""The one-shot peer-to-peer all-reduce (``radixd.core.peer_allreduce``) between the threads
of two GPUs: sums, identical bits on every rank, many calls in a row (the slots alternate),
odd sizes, and replays of CUDA graphs that contain it. Needs two CUDA devices (``-m gpu``)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.fixture(scope="module")
def peer():
    from radixd.core.peer_allreduce import PeerAllReduce, enable_peer_access

    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    if not enable_peer_access(devices):
        pytest.skip("the two GPUs cannot address each other's memory")
    return PeerAllReduce(devices, torch.bfloat16)


def on_ranks(fn):
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        return list(ex.map(fn, range(2)))


@pytest.mark.parametrize("n", [1, 4096, 4097, 64 * 4096, 512 * 1024])
def test_sums_equal_on_both_ranks(peer, n):
    parts = [torch.randn(50, n, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(2)]

    def rank(r):
        torch.cuda.set_device(r)
        outs = []
        for i in range(50):  # 50 calls in a row: both slot halves, reused
            t = parts[r][i].to(f"cuda:{r}")
            peer.all_reduce(r, t)
            outs.append(t)
        torch.cuda.synchronize(r)
        return torch.stack(outs).cpu()

    got = on_ranks(rank)
    want = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    assert torch.equal(got[0], got[1])  # the same bits on both ranks
    assert torch.equal(got[0], want)
    assert peer.check() == 0


def test_inside_cuda_graphs(peer):
    n = 4096
    both_idle = threading.Barrier(2)

    def rank(r):
        torch.cuda.set_device(r)
        x = torch.zeros(n, dtype=torch.bfloat16, device=f"cuda:{r}")
        peer.all_reduce(r, torch.zeros(n, dtype=torch.bfloat16, device=f"cuda:{r}"))  # compiled before capture
        torch.cuda.synchronize(r)
        # Capturing synchronizes and frees cached memory: never while the other GPU's
        # all-reduce waits for this one (TPWorker warms every shard up, then captures).
        both_idle.wait()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                for _ in range(8):  # eight all-reduces per replay, as layers do
                    peer.all_reduce(r, x)
        outs = []
        for step in range(20):
            x.fill_(float(r + 1) if step % 2 else 0.5 * (r + 1))
            g.replay()
            outs.append(x.clone())
        torch.cuda.synchronize(r)
        return torch.stack(outs).float().cpu()

    got = on_ranks(rank)
    for step in range(20):
        base = 3.0 if step % 2 else 1.5
        assert torch.equal(got[0][step], torch.full((n,), base * 2 ** 7))  # summed 8 times: x2 after the first
        assert torch.equal(got[1][step], got[0][step])
    assert peer.check() == 0


@pytest.mark.parametrize("rows,width", [(1, 4096), (7, 4096), (64, 4096), (3, 5120)])
def test_fused_add_rmsnorm_equals_all_reduce_then_norm(peer, rows, width):
    from radixd.core.triton_ops import add_rmsnorm

    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(rows, width, generator=g).to(torch.bfloat16) for _ in range(2)]
    residual = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16)

    def rank(r):
        torch.cuda.set_device(r)
        dev = f"cuda:{r}"
        res = residual.to(dev)
        out, res2 = peer.all_reduce_add_rmsnorm(r, parts[r].to(dev), res, weight.to(dev), 1e-5)
        assert res2 is res
        torch.cuda.synchronize(r)
        return out.cpu(), res.cpu()

    got = on_ranks(rank)
    summed = (parts[0].float() + parts[1].float()).to(torch.bfloat16).cuda(0)
    want_res = residual.cuda(0)
    want, _ = add_rmsnorm(summed, weight.cuda(0), 1e-5, want_res)
    for out, res in got:
        assert torch.equal(res, want_res.cpu())
        assert torch.equal(out, want.cpu())
    assert peer.check() == 0
