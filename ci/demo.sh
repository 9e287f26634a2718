#!/usr/bin/env bash
# Set up (idempotent) and train the digits classifier on 4 local CPU processes, once per
# gradient exchange: plain fp32 DDP, fp16, PowerSGD and hhook's THC at 4 bits.
# Each line: test accuracy and the bytes each rank handed to collectives (a header says
# what every field means).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
NPROC="${NPROC:-4}"
"${PYTHON:-python3}" examples/ddp_train.py --result-header
for hook in none fp16 powersgd thc; do
    OMP_NUM_THREADS=1 "${PYTHON:-python3}" -m torch.distributed.run --nproc-per-node "$NPROC" \
        examples/ddp_train.py --hook "$hook" "$@" 2> >(grep -v -e '^W.*run.py' -e '^\*\*\*' >&2)
done
