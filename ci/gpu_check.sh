#!/usr/bin/env bash
# hhook's CUDA path on one GPU in one prepared run of 270 s: one call of about five minutes
# on a lent GPU (docs/gpu.md):
#   bash ci/gpu_check.sh             on a machine with a GPU, torch and CuPy (nothing is installed)
#   bash ci/gpu_check.sh --dry-run   anywhere: every stage's machinery without a GPU (CI runs it)
# Writes gpu-check.json (after every stage) and gpu-check.log to $OUT when set, else to bench/.
# Other options (python3 ci/gpu_check.py --help): --budget SECONDS (default 270), --only
# STAGE|PRESET,... (presets: kernels, train; env always runs first), --step-runs 10gbit,1gbit,nccl1.
# The step stage emulates links with ci/netcluster.sh (its namespaces hh0, hh1, hhnet) where
# network namespaces work; it needs root there, and takes them down when it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # src layout: the package, and tests/
export PYTHONUNBUFFERED=1
# A fresh kernel cache: the env stage times the NVRTC compile from scratch, and a read-only
# home does not matter (hhook copes with one too; see src/hhook/codec/kernels/cuda.py).
# One machine: every rendezvous on loopback (NCCL leaves lo out unless told).
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$(mktemp -d -t hhook-cupy-XXXXXX)}"
exec "${PYTHON:-python3}" ci/gpu_check.py "$@"
