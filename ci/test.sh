#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: `bash ci/test.sh [pytest args]`;
# `bash ci/test.sh -m quick` runs the quick tier (a few minutes: docs/testing.md).
# Set-up installs Open MPI, mpi4py, Horovod and the frameworks of hhook's adapters (Lightning,
# Accelerate, Transformers, Ray Train, torchft), so a test skipped for want of one of them
# fails here (HHOOK_REQUIRE, tests/conftest.py): a Horovod that does not import is an
# error, not a skip. `HHOOK_REQUIRE= bash ci/test.sh` lets those tests skip instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh --full
export HHOOK_REQUIRE="${HHOOK_REQUIRE-horovod,mpi,lightning,accelerate,transformers,ray,torchft}"
# Several tests at once (pytest-xdist): most of a test's time is spent waiting for other
# processes (ranks starting, collectives, timeouts waited out), so one test at a time left
# the two cores half idle. A module whose tests share a wider fixture stays on one worker
# (tests/conftest.py). HHOOK_TEST_WORKERS=0 runs in this process (pdb, -s). docs/testing.md.
exec "${PYTHON:-python3}" -m pytest -q -rs -p no:benchmark -n "${HHOOK_TEST_WORKERS:-2}" --dist loadgroup "$@"
