"""Quantized test checkpoints: llmcompressor's ``oneshot`` (compressed-tensors, round-to-
nearest, no calibration data), and writers of the formats whose tools do not install here
beside torch (GPTQ: GPTQModel replaces torch; AWQ packed by AutoAWQ's own ``WQLinear_GEMM``;
block fp8 as DeepSeek / Qwen3-FP8 publish it), each from the same round-to-nearest
quantization (``radixd.core.quant.ops``' helpers). ``dense_twin`` writes a checkpoint of the
dequantized weights: transformers' reference where its loader needs a backend that does
not install on CPU (gptqmodel for GPTQ and AWQ). ``last_logits``: the forward-pass probe the
quantized tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from radixd.core.quant.ops import dequantize_fp8, pack_int4, quantize_fp8, quantize_int, unpack_int4

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def oneshot_checkpoint(src: Path, dst: Path, scheme: str | dict, ignore: tuple[str, ...] = ()) -> Path:
    """llmcompressor's ``oneshot`` with a preset scheme name (``"FP8_DYNAMIC"``, ``"W4A16"``)
    or a dict of ``QuantizationScheme`` fields; the LM head (and ``ignore``) left unquantized."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if isinstance(scheme, str):
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", *ignore])
    else:
        recipe = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                      ignore=["lm_head", *ignore])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)
    _copy_tokenizer(src, dst)
    return dst


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, dst / f.name)


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    _copy_tokenizer(src, dst)
    return dst


def _projections(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.removesuffix(".weight") for k in state if k.endswith(".weight") and k.split(".")[-2] in PROJ)


def gptq_checkpoint(src: Path, dst: Path, *, bits: int = 4, group: int = 32, sym: bool = True, desc_act: bool = False,
                    v2: bool = False, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """GPTQ's published layout (AutoGPTQ / GPTQModel): ``qweight`` [K*bits/32, N] packed along K,
    ``qzeros`` [G, N*bits/32] packed along N (minus one unless ``v2``), ``scales`` [G, N] fp16,
    ``g_idx`` [K]. ``desc_act``: columns quantized in a random order, as act-order does.
    Returns the path and each projection's dequantized weight."""
    state = load_file(src / "model.safetensors")
    dense = {}
    for p in _projections(state):
        w = state.pop(p + ".weight")
        n, k = w.shape
        # q/k/v (and gate/up) share one input, so GPTQ orders their columns alike
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + k)) if desc_act else torch.arange(k)
        q_p, s, z = quantize_int(w[:, perm].half().float(), bits, group, sym)
        s = s.half()
        q_p = _unpacked(q_p, bits)
        z = torch.full_like(s, 2 ** (bits - 1), dtype=torch.float32) if z is None else z.float()
        q = torch.empty_like(q_p)
        q[:, perm] = q_p
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        stored_z = z if v2 else (z - 1).remainder(2**bits)
        state[p + ".qweight"] = _pack_rows(q, bits).t()
        state[p + ".qzeros"] = _pack_rows(stored_z.t().to(torch.uint8), bits)
        state[p + ".scales"] = s.t()
        state[p + ".g_idx"] = g_idx
        dense[p] = ((q.float() - z[:, g_idx.long()]) * s.float()[:, g_idx.long()])
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return _write(src, dst, state, qc), dense


def _unpacked(q: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_int4(q) if bits == 4 else q


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C*bits/32], low bits first."""
    if bits == 4:
        return pack_int4(q)
    return q.contiguous().view(torch.int32)


def awq_checkpoint(src: Path, dst: Path, *, group: int = 32) -> tuple[Path, dict[str, torch.Tensor]]:
    """AWQ GEMM checkpoints packed by AutoAWQ's ``WQLinear_GEMM.from_linear`` (its own code,
    interleaved nibbles) from round-to-nearest asymmetric scales and zeros; the dequantized
    weights by AutoAWQ's ``dequantize_gemm``."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    state = load_file(src / "model.safetensors")
    dense = {}
    for p in _projections(state):
        w = state.pop(p + ".weight")
        n, k = w.shape
        _, s, z = quantize_int(w, 4, group, symmetric=False)
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w.clone()
        wq = WQLinear_GEMM.from_linear(lin, 4, group, scales=s.t().contiguous(), zeros=z.t().contiguous())
        state[p + ".qweight"], state[p + ".qzeros"], state[p + ".scales"] = wq.qweight, wq.qzeros, wq.scales
        dense[p] = dequantize_gemm(wq.qweight, wq.qzeros, wq.scales.float(), 4, group).t()  # (fp32: no fp16 rounding)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write(src, dst, state, qc), dense


def fp8_block_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] = (32, 32)) -> Path:
    """Block fp8 as DeepSeek-V3 / Qwen3-FP8 publish it: ``weight`` e4m3 and ``weight_scale_inv``."""
    state = load_file(src / "model.safetensors")
    for p in _projections(state):
        state[p + ".weight"], state[p + ".weight_scale_inv"] = quantize_fp8(state[p + ".weight"], "block", block)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    return _write(src, dst, state, qc)


FP8_CHANNEL_QC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]}


def fp8_experts_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] | None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A mixture of experts with only its experts in fp8 (attention, router and LM head left
    as they are): block fp8 as Qwen3-MoE-FP8 publishes it (``weight_scale_inv``), or with
    ``block`` None per channel as llmcompressor writes it (``weight_scale`` [N, 1]). Returns
    the path and each expert projection's dequantized weight."""
    state = load_file(src / "model.safetensors")
    dense = {}
    for key in [k for k in state if ".experts." in k and k.endswith(".weight")]:
        p = key.removesuffix(".weight")
        q, scale = quantize_fp8(state[key].float(), "block" if block else "channel", block or (128, 128))
        state[key] = q
        state[p + (".weight_scale_inv" if block else ".weight_scale")] = scale if block else scale[:, None]
        dense[p] = dequantize_fp8(q, scale, block)
    qc = ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
          if block else FP8_CHANNEL_QC)
    return _write(src, dst, state, qc), dense


def dense_twin(src: Path, dst: Path, dense: dict[str, torch.Tensor]) -> Path:
    """``src`` (the unquantized checkpoint) with each projection's weight replaced by ``dense``."""
    state = load_file(src / "model.safetensors")
    for p, w in dense.items():
        state[p + ".weight"] = w.to(state[p + ".weight"].dtype).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    _copy_tokenizer(src, dst)
    return dst



def decompressed_twin(path: Path, base: Path, dst: Path) -> Path:
    """``dense_twin`` of a pack-quantized checkpoint's weights as compressed-tensors'
    own decompressor reads them (transformers' loader cannot read asymmetric ones here, and
    decompresses symmetric ones far more slowly)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**{k: v for k, v in qc["config_groups"]["group_0"].items() if k != "format"})
    state = load_file(path / "model.safetensors")
    dense = {}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        p = key.removesuffix(".weight_packed")
        mod = {k.removeprefix(p + "."): v for k, v in state.items() if k.startswith(p + ".")}
        dense[p] = PackedQuantizationCompressor.decompress(mod, scheme)["weight"].float()
    return dense_twin(base, dst, dense)


def last_logits(eng, p: list[int]) -> torch.Tensor:
    """``eng``'s model's logits after prompt ``p`` (one forward pass, its KV freed after)."""
    from radixd.core.forward_batch import ForwardBatch

    slots = eng.allocator.alloc(len(p))
    batch = ForwardBatch(input_ids=torch.tensor(p), positions=torch.arange(len(p)), out_cache_loc=slots, rows=[0],
                         prefix_lens=[0], extend_lens=[len(p)], table_writes=[(0, 0, slots)], sample_indices=[0])
    try:
        return eng.worker.forward(batch)[0]
    finally:
        eng.allocator.free(slots)
