#!/usr/bin/env bash
# Re-measure the profiler pages (docs/profile-1gbit.md, docs/profile-100mbit.md): 4 Open MPI
# ranks on the emulated cluster (ci/netcluster.sh), the link fit, THC's allreduce against
# fp32/fp16/zlib at 25 MB under Open MPI's default algorithm and the segmented ring
# (coll_tuned_allreduce_algorithm 5), a size sweep (1 Gbit/s), and the ring model's plot.
# Needs root, ip netns, tc, Open MPI and mpi4py (bash ci/setup.sh --full).
# Usage: bash measure/measure_profiler.sh 1gbit|100mbit   (about 3-6 minutes each on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:?usage: measure/measure_profiler.sh 1gbit|100mbit}"
P="${PYTHON:-python3} -m hhook.profile"
export HH_MPIRUN_ARGS="${HH_MPIRUN_ARGS:-} -x PYTHONPATH=$PWD/src:$PWD"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT
bash ci/netcluster.sh up 4 "$RATE"
D="bench/profile-$RATE"  # measurements in bench/, the pages in docs/
if [[ "$RATE" == 1gbit ]]; then
    bash ci/netcluster.sh measure 100 --duplex
    LINK=(-b 1 -e 16M -f 4 -n 10 -w 2); ITER=(-n 8 -w 2); RING=(-n 10 -w 2); SIZES=25MB
else
    bash ci/netcluster.sh measure 50 --duplex
    LINK=(-b 1 -e 4M -f 4 -n 5 -w 1); ITER=(-n 5 -w 1); RING=(-n 5 -w 1); SIZES=1M,25MB
fi
bash ci/netcluster.sh mpirun 4 $P link "${LINK[@]}" --quiet --json "$D-link.json"
bash ci/netcluster.sh mpirun 4 $P allreduce --sizes "$SIZES" --bits 4 "${ITER[@]}" --fixed-iters --quiet --json "$D.json"
HH_MPIRUN_ARGS="$HH_MPIRUN_ARGS --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 5" \
    bash ci/netcluster.sh mpirun 4 $P allreduce --sizes 25MB --methods fp32,thc,fp16 --bits 4 "${RING[@]}" \
    --fixed-iters --quiet --json "$D-ring.json"
SWEEP=()
if [[ "$RATE" == 1gbit ]]; then
    bash ci/netcluster.sh mpirun 4 $P allreduce -b 64K -e 16M -f 4 --bits 4 --quiet --json "$D-sweep.json"
    SWEEP=(--allreduce-json "$D-sweep.json")
fi
$P model --link-json "$D-link.json" --allreduce-json "$D.json" "${SWEEP[@]}" --compute-ms 1000 --model-bytes 25MB \
    --json "$D-model.json" --plot "$D.png"
