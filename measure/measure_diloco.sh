#!/usr/bin/env bash
# DiLoCo across emulated sites (docs/diloco.md): hhook-profile train --model gpt on ci/netcluster.sh
# sites joined by shaped links with a one-way delay (measure/delaylink.py), one rank per site:
# DDP fp32 and DDP with hhook's per-step hook (thc:4) against hhook.diloco's outer synchronization
# (THC 4 bits at each H, an fp32 outer exchange, streamed in P fragments), equal tokens per site
# (every method runs STEPS steps of the same batches). Then SEEDS more runs of the THC and fp32
# outer exchanges alone, and measure/diloco_summary.py reads every run against issue 49's targets
# into OUTDIR/diloco.json (the figures, every run's JSON, the host's load before and after each run).
# Needs root, ip netns and tc. Usage: bash measure/measure_diloco.sh [OUTDIR] (default bench), with
#   STEPS (default 300) steps per method, EVAL (default 25) evaluate every EVAL steps,
#   SITES (default "2 4"), LINKS (default "100mbit:50": RATE:ONE_WAY_MS, e.g. "100mbit:50 1gbit:25"),
#   HS (default "50 100": H of the THC outer exchange; the first also for fp32 and streaming),
#   P (default 4) fragments and OVERLAP (default 2) inner steps of the streamed method,
#   SEEDS (default "1 2": the seeds of the repeats; seed 0 runs every method),
#   HH_PREFIX (default dlc) and HH_SUBNET (default 10.79.0): this cluster's names and addresses.
# A quick check of the script: STEPS=40 EVAL=10 HS="10 20" P=2 OVERLAP=2 SITES=2 SEEDS=1 bash measure/measure_diloco.sh /tmp/d
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench}"
STEPS="${STEPS:-300}"
EVAL="${EVAL:-25}"
HS="${HS:-50 100}"
P="${P:-4}"
OVERLAP="${OVERLAP:-2}"
PY="${PYTHON:-python3}"
export HH_PREFIX="${HH_PREFIX:-dlc}" HH_SUBNET="${HH_SUBNET:-10.79.0}"
read -r H0 _ <<<"$HS"
mkdir -p "$OUT"
RUNS=$(mktemp -d /tmp/diloco-runs.XXXXXX)   # every run's JSON until the summary takes them in
LOADS="$RUNS/loads.txt"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true; rm -rf "$RUNS"' EXIT

all="fp32,thc:4"
for h in $HS; do all="$all,diloco:4:h=$h"; done
all="$all,diloco:fp32:h=$H0,diloco:4:h=$H0:p=$P:overlap=$OVERLAP"
pair="diloco:4:h=$H0,diloco:fp32:h=$H0"

run() {  # run SITES RATE DELAY_MS SEED METHODS NAME
    local sites=$1 rate=$2 delay=$3 seed=$4 methods=$5 name=$6
    bash ci/netcluster.sh up "$sites" "$rate"
    bash ci/netcluster.sh delay "$delay"
    echo "$name before $(cat /proc/loadavg)" >>"$LOADS"
    bash ci/netcluster.sh launch "$sites" "$PY" -m hhook.profile train --quiet --model gpt --methods "$methods" \
        --steps "$STEPS" --warmup 5 --eval-every "$EVAL" --target-accuracy 0.99 --timeout 900 --seed "$seed" \
        --ranks-per-node 1 --json "$RUNS/$name.json"
    echo "$name after $(cat /proc/loadavg)" >>"$LOADS"
    bash ci/netcluster.sh down
}

for link in ${LINKS:-100mbit:50}; do
    rate=${link%%:*}; delay=${link#*:}
    for sites in ${SITES:-2 4}; do
        run "$sites" "$rate" "$delay" 0 "$all" "diloco-${sites}x-${rate}-${delay}ms"
        for seed in ${SEEDS:-1 2}; do
            run "$sites" "$rate" "$delay" "$seed" "$pair" "diloco-${sites}x-${rate}-${delay}ms-seed${seed}"
        done
    done
done
"$PY" measure/diloco_summary.py --loads "$LOADS" --out "$OUT/diloco.json" "$RUNS"/diloco-*.json
