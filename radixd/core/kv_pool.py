"""Token-level KV memory: the pool of KV slots and the request-to-token table.

Memory layout (one pool per worker, on its device)::

    k_buffers[layer]  [num_slots, num_kv_heads, head_dim]   slot 0 is a padding sink
    v_buffers[layer]  [num_slots, num_kv_heads, head_dim]
    req_to_token      [max_rows, max_context_len] int64      row r, position p -> slot

The buffers hold the model's dtype, or fp8 (``KVFormat``: ``k_scales[layer]`` and
``v_scales[layer]`` divide on the way in and multiply on the way out; ``store`` and ``read``
here, the Triton kernels in their own loads and stores).

With a window region (sliding-window layers, ``swa_pool``), the window layers' buffers have
``window_slots`` rows instead, read through ``to_window``.

The scheduler owns *which* slots a request uses (``SlotAllocator`` and the radix cache live
on the event-loop thread, on the CPU); the worker owns the buffers and the table, and applies
the table writes each batch carries before its forward pass.
"""

from __future__ import annotations

import torch

from radixd.core import cpu_kernels
from radixd.core.kv_quant import KVFormat, dequantize, quantize


class SlotAllocator:
    """Free list of KV slots. Slot 0 is never handed out (padding writes land there).

    Freed slots wait in a list of chunks and join the free tensor when an allocation needs
    them (one concatenation then, not one copy of the whole free list per release)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError("a KV pool needs at least 2 slots")
        self.total = num_slots - 1
        self._free = torch.arange(1, num_slots, dtype=torch.int64)
        self._freed: list[torch.Tensor] = []
        self._num_freed = 0

    @property
    def available(self) -> int:
        return int(self._free.numel()) + self._num_freed

    def _gather(self) -> None:
        if self._freed:
            # in slot order: a request's next allocation is then one run of consecutive slots
            # where the pool has one (what the CPU decode path reads in place), not the
            # interleaved slots of the requests that freed them
            self._free = torch.cat([self._free, *self._freed]).sort().values
            self._freed.clear()
            self._num_freed = 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots, or return None (and take nothing) if fewer are free."""
        if n > self._free.numel():
            if n > self.available:
                return None
            self._gather()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._freed.append(slots.to(torch.int64))
            self._num_freed += int(slots.numel())

    def free_slots(self) -> torch.Tensor:
        self._gather()
        return self._free


class RowAllocator:
    """Rows of the request-to-token table, one per running request."""

    def __init__(self, num_rows: int):
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * elem


class KVPool:
    """The per-layer K and V buffers and the request-to-token table (device side)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_format: KVFormat | None = None,
        windows: tuple[int, ...] = (),
        window_slots: int = 0,
    ):
        """``dtype``: the model's; ``kv_format``: what K/V are stored in (None: ``dtype``).
        ``windows``/``window_slots``: each layer's sliding window (0: none) and the size of
        the window layers' own region (0: no region; every layer has ``num_slots`` rows)."""
        self.num_slots = num_slots
        fmt = kv_format or KVFormat(dtype)
        self.dtype = fmt.dtype          # what the buffers hold
        self.model_dtype = dtype
        self.quantized = fmt.quantized
        self.k_scales = fmt.k_scales or (1.0,) * num_layers
        self.v_scales = fmt.v_scales or (1.0,) * num_layers
        self.device = device
        dtype = fmt.dtype
        self.window_slots = window_slots
        self.window = max(windows, default=0) if window_slots else 0
        rows = [window_slots if window_slots and windows[i] else num_slots for i in range(num_layers)]
        self.k_buffers = [torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device) for n in rows]
        self.v_buffers = [torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device) for n in rows]
        # slot -> window slot (swa_pool); None without a window region
        self.to_window = torch.zeros(num_slots, dtype=torch.int64, device=device) if window_slots else None
        self.req_to_token = torch.zeros((max_rows, max_context_len), dtype=torch.int64, device=device)
        self._load_stream = None  # CUDA: the side stream of write_pages

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantized:
            k, v = quantize(k, self.k_scales[layer], self.dtype), quantize(v, self.v_scales[layer], self.dtype)
        elif (self.device.type == "cpu" and loc.dtype == torch.int64 and cpu_kernels.store_takes(k, self.k_buffers[layer])
              and cpu_kernels.store_takes(v, self.v_buffers[layer])):
            cpu_kernels.store_rows(self.k_buffers[layer], loc, k)
            cpu_kernels.store_rows(self.v_buffers[layer], loc, v)
            return
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)

    def read(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots ``idx`` (any shape) in ``dtype``: ``[*idx.shape, kv_heads, head_dim]``."""
        flat = idx.reshape(-1)  # (index_select: on the CPU several times faster than buf[idx])
        shape = (*idx.shape, *self.k_buffers[layer].shape[1:])
        k = torch.index_select(self.k_buffers[layer], 0, flat).view(shape)
        v = torch.index_select(self.v_buffers[layer], 0, flat).view(shape)
        if self.quantized:
            return dequantize(k, self.k_scales[layer], dtype), dequantize(v, self.v_scales[layer], dtype)
        return k.to(dtype), v.to(dtype)

    # ------------------------------------------------------------------ pages (lower cache tiers)
    # Called on the scheduler's thread. On CUDA both directions are queued without waiting:
    # reads on the compute stream (ahead of any later step that reuses the slots) into a
    # device copy (the host tier moves it into page-locked memory); writes on a side stream that first waits for the compute stream
    # (a page read out of slots just evicted must be read before they are written again) and
    # records an event per layer, which the next step's attention of that layer waits for:
    # the copy of later layers overlaps the compute of earlier ones.

    def read_pages(self, slots: torch.Tensor, page_tokens: int) -> list:
        """Copy the KV of ``slots`` (a multiple of ``page_tokens``) to host pages."""
        from radixd.core.tiers.base import Page

        n = slots.numel() // page_tokens
        if self.device.type != "cuda":
            kv = self._gather(slots, n, page_tokens)
            return [Page(kv[i].contiguous()) for i in range(n)]
        with torch.cuda.device(self.device):
            # a copy on the device, queued on the compute stream: the host tier copies it
            # into its page-locked slab without waiting, other tiers when they write it
            kv = self._gather(slots.to(self.device, non_blocking=True), n, page_tokens).contiguous()
        return [Page(kv[i]) for i in range(n)]

    def _gather(self, idx: torch.Tensor, n: int, page_tokens: int) -> torch.Tensor:
        """[n, 2, layers, page_tokens, kv_heads, head_dim] (a view) of the KV of ``idx``."""
        kv = torch.stack([torch.stack([b[idx] for b in self.k_buffers]), torch.stack([b[idx] for b in self.v_buffers])])
        return kv.view(2, len(self.k_buffers), n, page_tokens, *kv.shape[3:]).transpose(0, 2).transpose(1, 2)

    def write_pages(self, slots: torch.Tensor, pages: list, skip: int):
        """Write ``pages`` (host) into ``slots``, dropping the first ``skip`` tokens of the
        first page. Returns None on CPU, else one CUDA event per layer (that layer's K and V
        are in place)."""
        if self.device.type != "cuda":
            kv = torch.cat([p.data for p in pages], dim=2)[:, :, skip:]
            for layer in range(len(self.k_buffers)):
                self.k_buffers[layer][slots] = kv[0, layer]
                self.v_buffers[layer][slots] = kv[1, layer]
            return None
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(self.device)
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        done = []
        with torch.cuda.stream(stream):
            for p in pages:
                if p.ready is not None:
                    stream.wait_event(p.ready)
            kv = torch.cat([p.data.to(self.device, non_blocking=True) for p in pages], dim=2)[:, :, skip:]
            idx = slots.to(self.device, non_blocking=True)
            for layer in range(len(self.k_buffers)):
                self.k_buffers[layer][idx] = kv[0, layer]
                self.v_buffers[layer][idx] = kv[1, layer]
                done.append(torch.cuda.Event())
                done[-1].record(stream)
        for p in pages:
            p.reads = done[-1]  # the host memory they came from may be reused after this
        return done
