#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: `bash ci/test.sh [pytest args]`.
# Set-up installs Open MPI, mpi4py, Horovod and the frameworks of hhook's adapters (Lightning,
# Accelerate, Transformers, Ray Train), so a test skipped for want of one of them
# fails here (HHOOK_REQUIRE, tests/conftest.py): a Horovod that does not import is an
# error, not a skip. `HHOOK_REQUIRE= bash ci/test.sh` lets those tests skip instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh --full
export HHOOK_REQUIRE="${HHOOK_REQUIRE-horovod,mpi,lightning,accelerate,transformers,ray}"
exec "${PYTHON:-python3}" -m pytest -q -rs "$@"
