"""KV-cache events: the radix cache's changes published over ZMQ in vLLM's format, for llm-d's
precise prefix-cache scorer (its kvcache indexer keeps, per pod, the blocks each engine holds).

Blocks
------
radixd's tree is token-level; the events speak of blocks of ``block_size`` tokens
(``[kv_events] block_size``). Block ``k`` of a cached sequence is its tokens
``[k*bs, (k+1)*bs)``; it is cached while the token at ``(k+1)*bs - 1`` is, and it belongs to
the tree node holding that token (``TreeNode.blocks``, partitioned again when a node splits).
Only whole blocks are reported; a partial tail joins the next block when a later insert
extends it. A block's hash chains as vLLM's do, over its parent's hash and its own tokens:
the first 8 bytes (big-endian, unsigned) of ``sha256(parent hash as 8 bytes | tokens as
little-endian u32)``, the parent of block 0 being no hash (``None`` in the event). The scorer
reads these hashes as opaque engine keys (it hashes the ``token_ids`` of each ``BlockStored``
itself), so only their consistency across events matters.

Wire format
-----------
As vLLM's ``ZmqEventPublisher`` (vllm/distributed/kv_events.py) sends it and llm-d's vLLM
adapter decodes it: a PUB socket, each message three frames ``[topic, seq, payload]`` with
``seq`` a big-endian 8-byte counter from 0 and ``payload`` a msgpack ``KVEventBatch`` encoded
as msgspec's ``array_like`` structs with defaults omitted: ``[ts, [event, ...], dp_rank]``
with events ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]`` and
``["AllBlocksCleared"]``. ``medium`` is ``"GPU"`` (the KV pool, as vLLM names its own). llm-d
reads the pod and model from a topic ``kv@<pod>@<model>``; ``$VAR`` in the topic is read from
the environment (a pod's name, from the downward API). Replica ``i`` of a
data-parallel engine publishes on the endpoint's port + ``i``, as vLLM's ranks do.

Contract
--------
``Recorder`` is the radix cache's ``listener``: the cache calls ``stored(node)`` after a new
node of namespace 0 enters the tree, ``removed(leaf)`` before a leaf of namespace 0 leaves
it, ``split(upper, lower)`` after a node is cut, ``cleared()`` after a flush emptied it; all
on the scheduler's thread. It only hashes the new blocks and queues the event; the
``Publisher``'s thread batches what is queued, encodes and sends it, off the batching loop.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from radixd.core.errors import ConfigError

if TYPE_CHECKING:
    from radixd.core.radix_cache import TreeNode

MEDIUM = "GPU"
_STOP = object()


def block_hash(parent: int | None, tokens: tuple[int, ...] | list[int]) -> int:
    head = b"" if parent is None else parent.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(head + struct.pack(f"<{len(tokens)}I", *tokens)).digest()[:8], "big")


class Recorder:
    """The radix cache's listener: blocks stored, removed, cleared, as events on ``sink``."""

    def __init__(self, block_size: int, sink: Any):
        self.block_size = block_size
        self.sink = sink  # .put(event)

    def stored(self, node: TreeNode) -> None:
        bs = self.block_size
        start, end = node.depth, node.depth + len(node.key)
        first = start // bs * bs  # the boundary the first new block starts from
        if end - first < bs:
            return
        tail: list[int] = []  # tokens [first, start), from the ancestors
        parent_hash = None
        up = node.parent
        while up is not None and not up.is_root and len(tail) < start - first:
            need = start - first - len(tail)
            tail[:0] = up.key[-need:]
            up = up.parent
        up = node.parent
        while up is not None and not up.is_root:
            if up.blocks:
                parent_hash = up.blocks[-1]
                break
            up = up.parent
        tokens = tail + list(node.key[: (end // bs * bs) - start])
        hashes = []
        h = parent_hash
        for k in range(0, len(tokens), bs):
            h = block_hash(h, tokens[k:k + bs])
            hashes.append(h)
        node.blocks = tuple(hashes)
        self.sink.put(["BlockStored", hashes, parent_hash, tokens, bs, None, MEDIUM, None])

    def removed(self, leaf: TreeNode) -> None:
        if leaf.blocks:
            self.sink.put(["BlockRemoved", list(leaf.blocks), MEDIUM])

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        bs = self.block_size
        cut = (lower.depth // bs) - (upper.depth // bs)  # blocks ending inside the upper part
        upper.blocks, lower.blocks = lower.blocks[:cut], lower.blocks[cut:]

    def cleared(self) -> None:
        self.sink.put(["AllBlocksCleared"])


class Publisher:
    """A ZMQ PUB socket and the thread that sends queued events, a batch per wake-up."""

    def __init__(self, endpoint: str, topic: str, dp_rank: int = 0, hwm: int = 100_000):
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ConfigError("kv_events.enabled", True, "false, or pyzmq and msgpack installed "
                              "(pip install 'radixd[kv-events]')") from exc

        self._pack = msgpack.Packer()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self.endpoint = offset_port(endpoint, dp_rank)
        if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
            self._sock.bind(self.endpoint)  # vLLM's rule: a wildcard binds, an address connects
        else:
            self._sock.connect(self.endpoint)
        self._topic = os.path.expandvars(topic).encode()  # e.g. kv@$POD_NAME@model in a pod
        self._dp_rank = dp_rank
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="radixd-kv-events", daemon=True)
        self._thread.start()

    def put(self, event: list) -> None:
        self._queue.put(event)

    def _run(self) -> None:
        while True:
            events = [self._queue.get()]
            while not self._queue.empty():
                events.append(self._queue.get())
            stop = any(e is _STOP for e in events)
            events = [e for e in events if e is not _STOP]
            if events:
                batch = [time.time(), events, self._dp_rank]
                self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), self._pack.pack(batch)])
                self._seq += 1
            if stop:
                return

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        self._sock.close(linger=1000)


def offset_port(endpoint: str, rank: int) -> str:
    """vLLM's per-rank endpoint: a tcp port + ``rank``, an inproc name + ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"
