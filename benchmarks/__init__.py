"""radixd's benchmark scripts, run from the repository root as ``python -m benchmarks.<script>``
(``benchmarks.common`` holds what they share; BENCHMARKS.md the figures they measured)."""
