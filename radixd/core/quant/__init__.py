"""Quantized weights' room: fp8 and int4/int8 weight layouts, their linear ops (``ops``) and
the kernels behind them. The checkpoint formats that produce these layouts, and the layers
that hold them, call ``ops``; nothing here reads a checkpoint.
"""
