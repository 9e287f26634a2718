#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian/Ubuntu machine for hhook, into the current Python
# environment (activate a venv first if you want one).
#   ci/setup.sh          torch==2.13.0 if missing (see below: on Linux x86-64 from PyPI that is the CUDA
#                        build, several GB), hhook in editable mode with its profile extras, pytest
#   ci/setup.sh --full   also Open MPI, mpi4py, Horovod 0.28.1 and the frameworks hhook adapts to
#                        (Lightning, Accelerate, Transformers, Ray Train, torchft; pinned): the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${HHOOK_TORCH_VERSION:-2.13.0}"

as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# What is downloaded: the pin fixes the VERSION that the tests were run with, not the build.
# `pip install torch==2.13.0` from PyPI on Linux x86-64 fetches the CUDA build: the torch wheel
# plus the nvidia-* CUDA libraries it depends on, several GB, even on a machine without a GPU.
# (Where pip's configuration offers a CPU wheel first, as on this project's machines, whose
# pip finds a local CPU wheel through find-links, it takes that one.) For the CPU build from
# PyTorch's own index, where that index is reachable:
#   HHOOK_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash ci/setup.sh
# which runs `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`.
# A torch that imports already is kept as it is.
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    "$PYTHON" -m pip install "torch==${TORCH_VERSION}" ${HHOOK_TORCH_INDEX:+--index-url "$HHOOK_TORCH_INDEX"}
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
