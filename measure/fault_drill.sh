#!/usr/bin/env bash
# fault_drill.sh -- inject each fault of docs/reliability.md into a training job with
# hhook.register(model) on the emulated cluster (2 nodes, 1 Gbit/s) and print one row per
# fault. Needs root (network namespaces, tc). The cluster is torn down at exit.
#
#   bash measure/fault_drill.sh                      # the full drill (about 20-30 minutes on 2 cores)
#   bash measure/fault_drill.sh --steps 200 --every 25 --long-steps 600 --only kill,stall   # a short one
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(id -u) == 0 ]] || { echo "fault_drill: must run as root (network namespaces and tc)" >&2; exit 1; }
command -v nft >/dev/null || { apt-get update -qq && apt-get install -y -qq nftables; }  # the lossy-link rows
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
bash ci/netcluster.sh up 2 1gbit
PYTHON=${PYTHON:-python3}
"$PYTHON" measure/fault_drill.py "$@"
