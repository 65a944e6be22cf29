"""Quantized weights' room: fp8 and int4/int8 weight layouts, their linear ops (``ops``) and
the kernels behind them. The checkpoint formats that produce these layouts, and the layers
that hold them, call ``ops``; nothing here reads a checkpoint.

    ops          the contract: fp8_linear, int_weight_linear, the layouts' helpers, the torch
                 references, and the dispatch to the kernels by device and row count
    gemv         1..GEMV_MAX_M rows: weight-streaming GEMVs, dequantization in the read
    fp8_rows     a decode batch's rows (2..128), fp8 weights: each weight tile streamed once past
                 all rows, K split where the tiles are few; chosen per shape by measurement
    fp8_gemm     more rows, fp8 weights: per-token activation quantization, fp8 tensor-core GEMM
    int_gemm     more rows, int4/int8 weights: tiles dequantized in registers, 16-bit GEMM

The fp8 numbers every module here shares are defined once, below.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # largest finite e4m3fn value
AMAX_EPS = 1e-10  # an all-zero row (or group) still gets a finite, non-zero scale
