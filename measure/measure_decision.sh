#!/usr/bin/env bash
# bits="auto" (hhook.register's default, src/hhook/decision/) against every fixed exchange,
# in one run per layout and link: wide-cnn, hhook-profile train with
# fp32, the fp16 hook, the bf16 hook, THC at 2, 3, 4 and 8 bits and thc:auto, written to
# OUT/decision-LAYOUT.json (the footer names what auto chose and its measured steps):
#
#   loopback-2, loopback-4      torchrun on this host, no network to save
#   2x10gbit, 2x1gbit, 2x100mbit, 4x1gbit   the emulated cluster (ci/netcluster.sh)
#
# Then the link-drop run: 2 ranks at 10 Gbit/s, each of fp32, thc:2, thc:4 and thc:auto launched
# alone, with the links reshaped to 100 Mbit/s DROP_AFTER_S seconds after its launch
# (ci/netcluster.sh reshape): OUT/decision-drop-METHOD.json.
# Needs root, ip netns and tc for the cluster parts. Usage:
#   bash measure/measure_decision.sh [OUTDIR] (default bench)
# STEPS (default 300), DROP_STEPS (default 600), DROP_AFTER_S (default 40),
# ONLY="loopback-2 2x1gbit drop" runs a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench}"
STEPS="${STEPS:-300}"
DROP_STEPS="${DROP_STEPS:-600}"
DROP_AFTER_S="${DROP_AFTER_S:-40}"
ONLY="${ONLY:-loopback-2 loopback-4 2x10gbit 2x1gbit 2x100mbit 4x1gbit drop}"
PY="${PYTHON:-python3}"
METHODS="fp32,fp16,bf16,thc:2,thc:3,thc:4,thc:8,thc:auto"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
mkdir -p "$OUT"

want() { [[ " $ONLY " == *" $1 "* ]]; }
train_args() {  # STEPS JSON METHODS
    echo -m hhook.profile train --quiet --model wide-cnn --methods "$3" --steps "$1" --warmup 5 \
        --eval-every 50 --target-accuracy 0.9 --timeout 3000 --json "$2"
}

for n in 2 4; do
    want "loopback-$n" || continue
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc-per-node "$n" \
        $(train_args "$STEPS" "$OUT/decision-loopback-$n.json" "$METHODS")
done
for layout in 2x10gbit 2x1gbit 2x100mbit 4x1gbit; do
    want "$layout" || continue
    n=${layout%%x*}; rate=${layout#*x}
    bash ci/netcluster.sh up "$n" "$rate"
    bash ci/netcluster.sh measure 20 || true   # the rate measured, for the record
    bash ci/netcluster.sh launch "$n" "$PY" $(train_args "$STEPS" "$OUT/decision-$layout.json" "$METHODS")
done
if want drop; then
    for method in fp32 thc:2 thc:4 thc:auto; do
        bash ci/netcluster.sh up 2 10gbit
        ( sleep "$DROP_AFTER_S"; bash ci/netcluster.sh reshape 100mbit ) &
        dropper=$!
        bash ci/netcluster.sh launch 2 "$PY" $(train_args "$DROP_STEPS" "$OUT/decision-drop-${method/:/-}.json" "$method")
        wait "$dropper" || true
    done
fi
bash ci/netcluster.sh down
