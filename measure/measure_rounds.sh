#!/usr/bin/env bash
# Round trips (issue 57, docs/usage.md "What a round costs"): hhook-profile train --model gpt,
# 2 ranks, side by side in one run per link: DDP fp32, the fp16 hook, THC 4 bits with agreed
# scales (a MAX round, then the SUM, two rounds a bucket), THC 4 bits with gathered scales (one
# all-gather a bucket; what scales="auto", the default, runs on CPUs over 2-4 ranks) and
# thc:auto (hhook.register's default). Links: loopback (plain torchrun, no namespaces) and ci/netcluster.sh links RATE:ONE_WAY_MS (the delay through measure/delaylink.py).
# Each link writes OUTDIR/rounds-MODEL-RANKSx-LINK.json (LINK: loopback or RATE-MS). Needs root, ip netns and tc for the emulated links.
# Usage: bash measure/measure_rounds.sh [OUTDIR] (default bench), with STEPS (default 60),
#   LINKS (default "loopback 1gbit:0 1gbit:10 100mbit:50"), RANKS (default 2), MODEL (default gpt),
#   METHODS (hhook-profile names, comma-separated).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench}"
STEPS="${STEPS:-60}"
RANKS="${RANKS:-2}"
MODEL="${MODEL:-gpt}"
PY="${PYTHON:-python3}"
METHODS="${METHODS:-fp32,fp16,thc:4:agreed,thc:4:gathered,thc:auto}"
mkdir -p "$OUT"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
ARGS=(-m hhook.profile train --quiet --model "$MODEL" --methods "$METHODS" --steps "$STEPS" --warmup 5
      --eval-every "$STEPS" --target-accuracy 0.99 --timeout 600)

for link in ${LINKS:-loopback 1gbit:0 1gbit:10 100mbit:50}; do
    name="rounds-${MODEL}-${RANKS}x-${link/:/-}"
    if [ "$link" = loopback ]; then
        "$PY" -m torch.distributed.run --standalone --nproc-per-node "$RANKS" "${ARGS[@]}" --json "$OUT/$name.json"
        continue
    fi
    rate=${link%%:*}; delay=${link#*:}
    bash ci/netcluster.sh up "$RANKS" "$rate"
    [ "$delay" = 0 ] || bash ci/netcluster.sh delay "$delay"
    bash ci/netcluster.sh launch "$RANKS" "$PY" "${ARGS[@]}" --ranks-per-node 1 --json "$OUT/$name.json"
    bash ci/netcluster.sh down
done
