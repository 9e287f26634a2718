#!/usr/bin/env bash
# Set up (idempotent), then train a communication-bound CNN on the digits with 2 CPU
# ranks, once per gradient exchange (plain fp32 DDP, the fp16 hook, hhook's THC at 4
# bits), and print step time, time to 90% test accuracy, final accuracy and bytes per
# rank and step side by side (hhook-profile train).
#
# Where it can (root, `ip netns`, `tc`), the ranks run on the emulated 1 Gbit/s cluster
# (ci/netcluster.sh: each rank in its own network namespace behind a shaped link), where
# the bytes THC saves show up as time. Otherwise they run on loopback, where the network
# is not the bottleneck and compression can only look like overhead.
# Extra arguments go to hhook-profile train (e.g. --steps 200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
PY="${PYTHON:-python3}"
ARGS=(--model wide-cnn --methods fp32,fp16,thc:4 --steps 100 --eval-every 10 --target-accuracy 0.9 --timeout 120 "$@")

if [[ $(id -u) -eq 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null && command -v unshare >/dev/null \
    && ip netns list >/dev/null 2>&1; then
    trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
    bash ci/netcluster.sh up 2 1gbit
    bash ci/netcluster.sh launch 2 "$PY" -m hhook.profile train "${ARGS[@]}"
else
    echo "demo: no root/ip netns/tc here, so the ranks run on loopback: the network is not the" \
         "bottleneck there and THC's saved bytes do not show as time (run as root for the emulated cluster)"
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc-per-node 2 -m hhook.profile train "${ARGS[@]}" \
        2> >(grep -v -e '^W.*run.py' -e '^\*\*\*' >&2)
fi
