#!/usr/bin/env bash
# The transformer benchmark of docs/train.md ("A transformer"): hhook-profile train --model gpt
# (a 3.3M-parameter decoder-only transformer on the Python help topics, no download) on the
# emulated cluster (ci/netcluster.sh) at 1 Gbit/s and 100 Mbit/s, 2 and 4 ranks: fp32, the
# fp16 and bf16 hooks, THC at 2, 3 and 4 bits, and thc:auto (hhook.register's default).
# Each run writes bench/gpt-RANKSx-RATE.json and .png: validation loss against training time
# (evals[].val_loss, time_s). Needs root, ip netns and tc. Usage: bash measure/measure_gpt.sh [OUTDIR]
# (default bench); STEPS=N steps per method (default 150), EVAL=K evaluate every K steps (default 15),
# RATES and RANKS the layouts (default "1gbit 100mbit" and "2 4"), e.g.
# RATES=100mbit RANKS=2 STEPS=60 bash measure/measure_gpt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench}"
STEPS="${STEPS:-150}"
EVAL="${EVAL:-15}"
PY="${PYTHON:-python3}"
METHODS="fp32,fp16,bf16,thc:2,thc:3,thc:4,thc:auto"
mkdir -p "$OUT"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT

for rate in ${RATES:-1gbit 100mbit}; do
    for ranks in ${RANKS:-2 4}; do
        bash ci/netcluster.sh up "$ranks" "$rate"
        bash ci/netcluster.sh launch "$ranks" "$PY" -m hhook.profile train --quiet --model gpt --methods "$METHODS" \
            --steps "$STEPS" --warmup 5 --eval-every "$EVAL" --target-accuracy 0.99 --timeout 600 \
            --json "$OUT/gpt-${ranks}x-${rate}.json" --plot "$OUT/gpt-${ranks}x-${rate}.png"
        bash ci/netcluster.sh down
    done
done
