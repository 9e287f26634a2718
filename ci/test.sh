#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: `bash ci/test.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh --full
exec "${PYTHON:-python3}" -m pytest -q -rs "$@"
