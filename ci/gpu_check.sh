#!/usr/bin/env bash
# hhook's CUDA path on one GPU in one prepared run, under 8 minutes (docs/gpu.md):
#   bash ci/gpu_check.sh             on a machine with a GPU, torch and CuPy (nothing is installed)
#   bash ci/gpu_check.sh --dry-run   anywhere: every stage that needs no GPU (CI runs it)
# Writes gpu-check.json and gpu-check.log to $OUT when set, else to bench/. Other options:
# --budget SECONDS (default 450), --only STAGE,... (python3 ci/gpu_check.py --help); --only speed
# prints issue 44's table (THC against the fp16 hook's casts and a copy) in under 2 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# A fresh kernel cache: the env stage times the NVRTC compile from scratch, and a read-only
# home does not matter (hhook copes with one too; see hhook/codec/kernels/cuda.py).
# One machine: every rendezvous on loopback (NCCL leaves lo out unless told).
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$(mktemp -d -t hhook-cupy-XXXXXX)}"
exec "${PYTHON:-python3}" ci/gpu_check.py "$@"
