#!/usr/bin/env bash
# The test suite under torch 2.11 (the GPU machines' torch, the oldest hhook supports), on the CPU:
#   bash ci/torch211.sh [pytest args]        e.g. bash ci/torch211.sh tests/integrations/test_fsdp.py
# Into a virtual environment of its own (.venv-torch211, or $HHOOK_TORCH211_VENV): PyPI's torch 2.11.0
# (its CUDA build, about 3 GB with its nvidia-* packages; it runs on a CPU), hhook in editable mode and
# pytest, and mpi4py where Open MPI is installed (hhook-profile's default backend; `bash ci/setup.sh --full`
# installs it). Tests of packages it does not install (Horovod, the frameworks) skip. Not part of
# CI (the download); run it before submitting work that touches torch.distributed or FSDP2.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HHOOK_TORCH211_VENV:-.venv-torch211}"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(not torch.__version__.startswith("2.11."))' 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.11.0"
fi
extras="dev"
command -v mpicc >/dev/null && extras="dev,mpi"
"$VENV/bin/python" -m pip install -q -e ".[$extras]"
export HHOOK_REQUIRE=""
exec "$VENV/bin/python" -m pytest -q -rs "$@"
