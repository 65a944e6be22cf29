"""The built-in KV transfer backend ``mooncake``: the Mooncake transfer engine
(``mooncake-transfer-engine`` on PyPI; ``mooncake-transfer-engine-non-cuda`` on machines
without CUDA), a plugin like any other.

Peers find each other without a metadata server (Mooncake's ``P2PHANDSHAKE``): a session is
named ``host:rpc_port``. The protocol is RDMA on ``[disaggregation] ib_device`` when one is
named, else TCP (machines without an RDMA device, CI). The package is imported when a
daemon in a prefill or decode role makes the backend, not before: a colocated daemon never
needs it.
"""

from __future__ import annotations

from radixd.core.errors import ConfigError
from radixd.plugins.markers import hookimpl


class MooncakeTransport:
    """``radixd.core.disagg.KVTransport`` over one Mooncake ``TransferEngine``."""

    def __init__(self, hostname: str, options: dict):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError("disaggregation.transfer_backend", "mooncake",
                              f"an importable Mooncake transfer engine (pip install "
                              f"mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda "
                              f"without CUDA): {exc}") from exc
        device = options.get("ib_device", "")
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "rdma" if device else "tcp", device)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {hostname} (code {rc})")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, buffers: list[tuple[int, int]]) -> None:
        for ptr, length in buffers:
            if self._engine.register_memory(ptr, length) != 0:
                raise RuntimeError(f"Mooncake could not register {length} bytes at {ptr:#x}")
            self._registered.append(ptr)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        if not lens:
            return
        rc = self._engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer to {peer} failed (code {rc})")

    def close(self) -> None:
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered.clear()


@hookimpl
def radixd_kv_transfer_backends() -> dict[str, type]:
    return {"mooncake": MooncakeTransport}
