#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian/Ubuntu machine for hhook, into the current Python
# environment (activate a venv first if you want one).
#   ci/setup.sh          torch==2.13.0 if missing (PyPI's default build for the platform; a CPU wheel
#                        on this project's machines), hhook in editable mode with its profile extras, pytest
#   ci/setup.sh --full   also Open MPI, mpi4py, Horovod 0.28.1 and the frameworks hhook adapts to
#                        (Lightning, Accelerate, Transformers, Ray Train; pinned): the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${HHOOK_TORCH_VERSION:-2.13.0}"

as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# Pinned on purpose: an unpinned `torch` resolves to a multi-GB CUDA build.
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    "$PYTHON" -m pip install "torch==${TORCH_VERSION}"
fi
"$PYTHON" -m pip install -q -e ".[dev]"

if [[ "${1:-}" == "--full" ]]; then
    if ! command -v mpirun >/dev/null || ! dpkg -s libopenmpi-dev >/dev/null 2>&1; then
        as_root apt-get update
        as_root apt-get install -y --no-install-recommends libopenmpi-dev openmpi-bin
    fi
    "$PYTHON" -m pip install -q -e ".[dev,mpi,frameworks]"
    bash ci/install_horovod.sh
fi
