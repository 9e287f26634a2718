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

can_emulate() {  # root with the rights to make a network namespace (not only to list them)
    [[ $(id -u) -eq 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null && command -v unshare >/dev/null \
        && ip netns add "hhdemo-probe-$$" >/dev/null 2>&1 && ip netns del "hhdemo-probe-$$" >/dev/null 2>&1
}

if can_emulate && bash ci/netcluster.sh up 2 1gbit; then
    trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
    bash ci/netcluster.sh launch 2 "$PY" -m hhook.profile train "${ARGS[@]}"
else
    bash ci/netcluster.sh down >/dev/null 2>&1 || true
    echo "demo: the emulated cluster needs root with ip netns and tc, so the ranks run on loopback: the" \
         "network is not the bottleneck there and THC's saved bytes do not show as time"
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc-per-node 2 -m hhook.profile train "${ARGS[@]}" \
        2> >(grep -v -e '^W.*run.py' -e '^\*\*\*' >&2)
fi
