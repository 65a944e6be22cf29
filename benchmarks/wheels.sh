#!/bin/sh
# The wheels that `WHEELS=DIR sh benchmarks/gpu_all.sh` installs on a GPU machine with no
# package index: what radixd's serving, benchmarks and tests need beyond the machine's own
# torch, triton, transformers and numpy, downloaded here for its Python:
#
#   sh benchmarks/wheels.sh DIR [PYTHON_VERSION]      (default 3.12)
#
# Binary wheels only, for manylinux x86-64; each package's dependencies come too, but gguf's
# (numpy, pyyaml, tqdm: the machine's own serve).
set -eu
DIR=$1
PY=${2:-3.12}
mkdir -p "$DIR"
fetch() {
  python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform any -d "$DIR" "$@"
}
fetch starlette hypercorn sse-starlette structlog lark pluggy prometheus-client httpx aiohttp filelock \
    pytest pytest-asyncio pytest-timeout
fetch --no-deps gguf
ls "$DIR"
