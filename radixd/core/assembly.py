"""Putting an engine together: what is known of the model before its weights load
(``ModelSetup``: device, dtype, checkpoint, tokenizer, context, EOS ids, whether it embeds;
the parallel layout checked against it), the KV pool's size, the workers of each replica, and the identity that
stored KV pages carry.

    EngineConfig -> ModelSetup.load -> replica_devices(d) -> make_worker (ModelWorker or
    TPWorker; the worker calls kv_slots once the weights are on its devices)

Everything here runs once, at start-up, on the caller's thread.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from radixd.core import gguf
from radixd.core.config import EngineConfig
from radixd.core.cpu_setup import auto_dtype, set_threads
from radixd.core.errors import ConfigError
from radixd.core.hf_names import hf_names
from radixd.core.kv_manager import FREE_EVERY
from radixd.core.kv_pool import kv_bytes_per_token
from radixd.core.kv_quant import FP8_DTYPES, KVFormat, is_scale_name, kv_format
from radixd.core.model_loader import iter_safetensors, read_config, resolve_model
from radixd.core.models.config import ModelConfig
from radixd.core.pooling import Pooling, engine_pooling
from radixd.core.swa_pool import window_slots
from radixd.core.tiers import TierContext
from radixd.core.triton_ops import KernelChoice
from radixd.core.worker import ModelWorker, Worker, on_device

log = logging.getLogger("radixd.assembly")

DEFAULT_KV_BYTES_CPU = 512 * 1024**2
# The prompt budget of a step that also decodes where such steps replay CUDA graphs (8B shape,
# 512 prompts at 256 streams on an H200: inter-token p99 / p50 3.0x in process, 2.1x over HTTP,
# 1.06x the requests a second of no budget; docs/benchmarks/gpu_wave2.md, "G4").
MIXED_PREFILL_CAPTURED = 512
MIXED_GRAPH_TOKENS_MAX = 1024  # the most prompt tokens of a captured mixed step by default


@dataclass(frozen=True)
class ModelSetup:
    """The model as the engine sees it before any weights load."""

    device: torch.device          # the engine's device kind (replicas pick theirs from it)
    dtype: torch.dtype
    path: Path                    # the checkpoint
    cfg: ModelConfig
    tokenizer: object | None      # None: token ids in and out only (tokenizer = "none")
    context_len: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str        # "auto" resolved
    pooling: Pooling | None       # how it embeds ([model] task); None: it generates
    kv_format: KVFormat           # what the KV pool stores (kv_cache_dtype; fp8 scales read)

    @classmethod
    def load(cls, config: EngineConfig) -> ModelSetup:
        """Read the checkpoint's config and tokenizer; check dp/tp against them."""
        device = pick_device(config.device)
        if device.type == "cpu":
            set_threads()
        path = resolve_model(config.model, config.cache_dir,
                             gguf_weights=gguf.choose(config.gguf_weights, device, config.tp_size))
        cfg = read_config(path, config.quantization)
        tokenizer = None if config.tokenizer == "none" else load_tokenizer(config.tokenizer or path)
        check_parallel(config, cfg, device)
        if config.speculative_eagle_topk > 1 and any(cfg.layer_windows):
            # (the tree mask is applied by table position; a window counts RoPE positions)
            raise ConfigError("speculative_eagle_topk", config.speculative_eagle_topk,
                              "1 on a model with sliding-window layers (token trees need full attention)")
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        dtype = pick_dtype(config.dtype, device)
        quantized = config.kv_cache_dtype in FP8_DTYPES and config.load_format != "dummy"
        scales = iter_safetensors(path, only=is_scale_name) if quantized else ()
        fmt = kv_format(config.kv_cache_dtype, dtype, cfg.num_layers, scales, device.type, backend)
        return cls(device=device, dtype=dtype, path=path, cfg=cfg, tokenizer=tokenizer,
                   context_len=min(cfg.context_len, config.max_context_len or 1 << 62),
                   eos_token_ids=eos_ids(cfg, tokenizer), attention_backend=backend,
                   pooling=engine_pooling(config.task, path), kv_format=fmt)


def mixed_steps(config: EngineConfig, setup: ModelSetup, aux_layers: tuple[int, ...] = ()) -> EngineConfig:
    """``config`` with the steps that decode and prefill together settled: their prompt
    budget (``mixed_prefill_tokens``; 0: ``MIXED_PREFILL_CAPTURED`` where they replay CUDA
    graphs, else ``max_prefill_tokens``) and their graphs' extra tokens (``mixed_graph_tokens``;
    0: the budget up to ``MIXED_GRAPH_TOKENS_MAX`` where they are captured, else none). An
    explicit ``mixed_graph_tokens`` where nothing would be captured is refused."""
    c = config
    possible = c.cuda_graphs and c.mixed_cuda_graphs and c.tp_size == 1 and not aux_layers
    if c.mixed_graph_tokens and not possible:
        raise ConfigError("mixed_graph_tokens", c.mixed_graph_tokens,
                          "0 with tp_size > 1, an EAGLE-3 drafter, cuda_graphs or mixed_cuda_graphs off (mixed "
                          "steps are captured as CUDA graphs on one device, without the drafter's hidden states)")
    captured = (possible and setup.device.type == "cuda" and setup.attention_backend == "triton"
                and setup.pooling is None)
    budget = min(c.mixed_prefill_tokens or (MIXED_PREFILL_CAPTURED if captured else c.max_prefill_tokens),
                 c.max_prefill_tokens)
    graph = c.mixed_graph_tokens or (min(budget, MIXED_GRAPH_TOKENS_MAX) if captured else 0)
    return replace(c, mixed_prefill_tokens=budget, mixed_graph_tokens=graph)


def mixed_uncaptured(asked: EngineConfig, config: EngineConfig, worker: Worker) -> EngineConfig:
    """A replica's ``config`` once its ``worker`` is made (``asked``: before ``mixed_steps``):
    where its mixed graphs were to be captured and the capture failed (the worker logged why),
    a budget ``mixed_steps`` chose for them goes back to ``max_prefill_tokens``: eager mixed
    steps are host-bound, and many small ones cost more than a few large ones."""
    failed = config.mixed_graph_tokens and getattr(worker, "graphs_wanted", False) \
        and getattr(worker, "mixed_graphs", None) is None
    if not failed or asked.mixed_prefill_tokens:
        return config
    log.warning("mixed steps run eagerly: no prompt budget of their own (max_prefill_tokens %d)",
                config.max_prefill_tokens)
    return replace(config, mixed_prefill_tokens=config.max_prefill_tokens)


def make_worker(config: EngineConfig, setup: ModelSetup, devices: list[torch.device],
                aux_layers: tuple[int, ...] = ()) -> Worker:
    """One replica's worker: the model on ``devices[0]``, or split over all of them.
    ``aux_layers``: the layers whose residual stream its steps hand back (an EAGLE-3
    drafter's; one device only)."""
    kw = dict(model_path=setup.path, model_cfg=setup.cfg, dtype=setup.dtype, load_format=config.load_format,
              attention_backend=setup.attention_backend, kv_slots=lambda free: kv_slots(config, setup, free),
              max_rows=config.max_running_requests, max_context_len=setup.context_len,
              cuda_graphs=config.cuda_graphs and setup.pooling is None,  # (embedding engines never decode)
              cascade_attention=config.cascade_attention,
              kernels=KernelChoice(fuse_one_row=config.fuse_one_row, rows_kernel=config.rows_kernel,
                                   dense_prefill=config.dense_prefill,
                                   prefill_weights=config.prefill_weights, pdl=config.pdl,
                                   merge_in_kernel=config.decode_merge_in_kernel),
              head=setup.pooling is None, kv_format=setup.kv_format,
              window_slots=window_region(config, setup),
              tree_graphs=bool(config.speculative_algorithm) and config.speculative_eagle_topk > 1,
              prefill_limits=(config.chunked_prefill_size, config.max_prefill_tokens),
              mixed_graph_tokens=config.mixed_graph_tokens)
    if config.pdl and not all(d.type == "cuda" and torch.cuda.get_device_capability(d)[0] >= 9 for d in devices):
        raise ConfigError("pdl", config.pdl, "false unless every device is a CUDA GPU of compute capability 9.0 "
                          "or more (programmatic dependent launch)")
    if config.decode_merge_in_kernel and setup.attention_backend != "triton":
        raise ConfigError("decode_merge_in_kernel", config.decode_merge_in_kernel,
                          f"false with attention_backend {setup.attention_backend!r} (it is the triton "
                          "backend's decode kernel)")
    if len(devices) > 1:
        from radixd.core.tensor_parallel import TPWorker

        del kw["mixed_graph_tokens"]

        if aux_layers:  # (a shard's stream is a partial sum until the next layer's all-reduce)
            raise ConfigError("tp_size", config.tp_size, f"1 with speculative_algorithm "
                              f"{config.speculative_algorithm!r} (its drafter reads the model's hidden states)")
        return TPWorker(devices=devices, peer_all_reduce=config.peer_all_reduce, **kw)
    with on_device(devices[0]):
        return ModelWorker(device=devices[0], aux_layers=aux_layers, **kw)


def kv_slots(config: EngineConfig, setup: ModelSetup, free_bytes: int | None) -> int:
    """Pool size in slots; called by the worker once the weights are on the device
    (``free_bytes``: the device's free memory then, None on CPU)."""
    c = config
    if c.kv_cache_tokens is not None and c.kv_cache_bytes is None:
        return c.kv_cache_tokens + 1
    # each device of a replica holds its share of the KV heads
    kv_heads = setup.cfg.num_kv_heads // c.tp_size
    windowed = sum(1 for w in setup.cfg.layer_windows if w) if window_ratio(config, setup) else 0
    # (with a window region, a slot's own layers and its share of a window slot)
    kv_dtype = setup.kv_format.dtype
    per_token = (kv_bytes_per_token(setup.cfg.num_layers - windowed, kv_heads, setup.cfg.head_dim, kv_dtype)
                 + c.swa_full_tokens_ratio * kv_bytes_per_token(windowed, kv_heads, setup.cfg.head_dim, kv_dtype))
    budget = c.kv_cache_bytes
    if budget is None:
        budget = int(free_bytes * c.mem_fraction) if free_bytes is not None else DEFAULT_KV_BYTES_CPU
    return max(2, int(budget // per_token) + 1)


def window_ratio(config: EngineConfig, setup: ModelSetup) -> float:
    """The window region's share of the pool's slots (``swa_pool``); 0: no region (no sliding
    window, or lower cache tiers)."""
    if not any(setup.cfg.layer_windows) or config.cache_tiers:
        return 0.0
    return config.swa_full_tokens_ratio


def window_region(config: EngineConfig, setup: ModelSetup) -> Callable[[int], int] | None:
    """The window region's size for a pool of n slots (None: no region): its share, and at
    least a prefill chunk and a window (so that one request always gets its next chunk)."""
    ratio = window_ratio(config, setup)
    if not ratio:
        return None
    window = max(setup.cfg.layer_windows)
    least = config.chunked_prefill_size + window + min(FREE_EVERY, window) + 1
    return lambda n: max(window_slots(n, ratio), least + 1)


def check_parallel(config: EngineConfig, cfg: ModelConfig, device: torch.device) -> None:
    """dp_size/tp_size against the model's shape and the visible devices."""
    tp = config.tp_size
    widths = [("KV heads", cfg.num_kv_heads), ("attention heads", cfg.num_heads), ("MLP width", cfg.intermediate_size)]
    if cfg.moe is not None:
        widths += [("experts' MLP width", cfg.moe.intermediate_size),
                   ("shared expert's MLP width", cfg.moe.shared_intermediate_size)]
    for what, n in widths:
        if n % tp:
            raise ConfigError("tp_size", tp, f"a divisor of the model's {what} ({n}); the model has "
                              f"{cfg.num_heads} heads, {cfg.num_kv_heads} KV heads")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if config.dp_size * tp > visible:
            raise ConfigError("dp_size", config.dp_size,
                              f"dp_size * tp_size <= {visible} (the visible CUDA devices); tp_size is {tp}")


def replica_devices(device: torch.device, d: int, dp: int, tp: int) -> list[torch.device]:
    """Devices of replica ``d``: cuda:d*tp .. cuda:d*tp+tp-1 (the default device when one
    replica uses one GPU); on CPU, tp CPU workers."""
    if device.type != "cuda":
        return [device] * tp
    if dp * tp == 1:
        return [device]
    return [torch.device("cuda", d * tp + t) for t in range(tp)]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", name, "'cpu' (no CUDA device is visible) or 'auto'")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else auto_dtype()
    return getattr(torch, name)


def load_tokenizer(path):
    (AutoTokenizer,) = hf_names("AutoTokenizer")
    return AutoTokenizer.from_pretrained(str(path))


def eos_ids(cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model's config plus the tokenizer's (if there is one)."""
    ids = list(cfg.eos_token_ids)
    tid = None if tokenizer is None else tokenizer.eos_token_id
    if tid is not None and tid not in ids:
        ids.append(tid)
    return tuple(ids)


def tier_context(config: EngineConfig, setup: ModelSetup) -> TierContext:
    """What the cache tiers of this engine learn about it."""
    m = setup.cfg
    return TierContext(identity=kv_identity(config, setup),
                       page_shape=(2, m.num_layers, config.cache_page_tokens, m.num_kv_heads, m.head_dim),
                       dtype=setup.kv_format.dtype, device=setup.device)


def kv_identity(config: EngineConfig, setup: ModelSetup) -> str:
    """What makes stored KV valid for this engine: the model's config and weights files,
    dtype, device kind, attention backend, page size and, for a pool not in the model's dtype
    (fp8, or a float32 model's 16-bit pool), its format and scales (pages of another identity
    are misses)."""
    h = hashlib.sha256(b"radixd-kv-pages-1")
    path = setup.path
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".gguf", ".bin") and config.load_format != "dummy":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    c = config
    h.update(f"{c.load_format}|{setup.dtype}|{setup.device.type}|{c.attention_backend}|{c.cache_page_tokens}".encode())
    if setup.kv_format.dtype != setup.dtype:  # (pools of the model's dtype keep the identity their pages have)
        h.update(f"|kv {setup.kv_format.identity}".encode())
    return h.hexdigest()
