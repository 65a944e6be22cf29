"""KV-cache events over ZMQ, as llm-d's precise prefix-cache scorer reads them: a SUB socket
decodes vLLM's framing (topic, 8-byte sequence, msgpack KVEventBatch of array-like events)
and rebuilds the set of cached blocks, which equals the blocks of the radix cache (hashed
here from each cached path's own tokens) through inserts, node splits, evictions and a
flush; each BlockStored's hashes chain from its parent over its token ids."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from conftest import make_tiny_checkpoint

from radixd import Engine, SamplingParams
from radixd.core.kv_events import block_hash, offset_port

BS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvev") / "llama", "llama")


def cache_blocks(cache) -> set[int]:
    """The whole blocks of every cached sequence, hashed from the tree's tokens."""
    out: set[int] = set()
    stack = [(cache.shared_root, ())]
    while stack:
        node, tokens = stack.pop()
        tokens = tokens + node.key
        h = None
        for k in range(0, len(tokens) // BS * BS, BS):
            h = block_hash(h, tokens[k:k + BS])
            out.add(h)
        stack.extend((c, tokens) for c in node.children.values())
    return out


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.topic = topic
        self.blocks: set[int] = set()
        self.seq = -1
        self.kinds: list[str] = []

    def drain(self, want: set[int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.blocks != want and time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic and int.from_bytes(seq, "big") == self.seq + 1
            self.seq += 1
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp_rank == 0
            for ev in events:
                self.kinds.append(ev[0])
                if ev[0] == "BlockStored":
                    hashes, parent, tokens, size, lora_id, medium, lora_name = ev[1:]
                    assert size == BS and len(tokens) == BS * len(hashes) and medium == "GPU"
                    assert lora_id is None and lora_name is None
                    assert parent is None or parent in self.blocks
                    h = parent
                    for k, want_h in enumerate(hashes):
                        h = block_hash(h, tokens[k * BS:(k + 1) * BS])
                        assert h == want_h
                    self.blocks.update(hashes)
                elif ev[0] == "BlockRemoved":
                    assert ev[2] == "GPU" and set(ev[1]) <= self.blocks
                    self.blocks.difference_update(ev[1])
                else:
                    assert ev == ["AllBlocksCleared"]
                    self.blocks.clear()
        assert self.blocks == want


async def run(eng, prompts, max_new=3):
    for p in prompts:
        async for _ in eng.generate(input_ids=p, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True)):
            pass


async def test_subscriber_rebuilds_the_cached_blocks(model, tmp_path, monkeypatch):
    endpoint = f"ipc://{tmp_path}/kv-events"
    monkeypatch.setenv("POD_NAME", "pod-a")  # the topic llm-d reads, the pod's name from the environment
    eng = Engine(model=str(model), kv_cache_tokens=96, kv_events=True, kv_events_endpoint=endpoint,
                 kv_events_topic="kv@$POD_NAME@tiny", kv_events_block_size=BS)
    sub = Subscriber(endpoint, b"kv@pod-a@tiny")
    time.sleep(0.3)  # a SUB socket hears only what is sent after it joined
    cache = eng.replicas[0].cache
    try:
        system = list(range(10, 31))  # 21 tokens: 5 whole blocks and one token more
        await run(eng, [system + [40, 41, 42], system + [50, 51], system[:9] + [60, 61, 62, 63, 64]])
        first = cache_blocks(cache)
        assert len(first) >= 7
        sub.drain(first)
        # more distinct prompts than the 96-slot pool holds: the oldest leaves are evicted
        await run(eng, [[100 + 20 * i + t for t in range(22)] for i in range(6)])
        after = cache_blocks(cache)
        assert not first <= after
        sub.drain(after)
        assert "BlockRemoved" in sub.kinds
        assert eng.flush_cache()
        sub.drain(set())
        assert sub.kinds[-1] == "AllBlocksCleared"
        await run(eng, [system + [70]])
        sub.drain(cache_blocks(cache))
        assert sub.blocks
    finally:
        await eng.stop()
        sub.sock.close(linger=0)


async def test_off_by_default(model):
    eng = Engine(model=str(model), kv_cache_tokens=64)
    try:
        assert eng.replicas[0].kv_events is None and eng.replicas[0].cache.listener is None
    finally:
        await eng.stop()


def test_data_parallel_ranks_take_their_own_port():
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("inproc://cache", 1) == "inproc://cache_dp1"
