#!/usr/bin/env bash
# Break five behaviours by hand, one at a time, in a copy of a checkout, and name the test
# that catches each (docs/testing.md, "Nothing lost"):
#   bash ci/break_check.sh SRC_TREE OUTDIR [pytest args]    e.g.
#   bash ci/break_check.sh . /tmp/breaks -p no:benchmark -n 3 --dist loadgroup -m quick
# A break whose sed no longer matches the code says so (update it with the code).
set -u
SRC=$(realpath "$1"); OUT=$(realpath -m "$2"); shift 2
mkdir -p $OUT
declare -A SED FILE
FILE[1]=src/hhook/codec/kernels/csrc/thc_cpu.c;  SED[1]='s/+ st->offset) << (24 - L)/+ st->offset + 1) << (24 - L)/'
FILE[2]=src/hhook/schedule/handshake.py;         SED[2]='s/if agrees(group, digest(words), device, counters, torch.int32):/if agrees(group, 0, device, counters, torch.int32):/'
FILE[3]=src/hhook/state/validate.py;             SED[3]='s/^            _int(saved\[name\], at + name)$/            pass/'
FILE[4]=src/hhook/codec/weights.py;              SED[4]='s/        y.sub_(self.q).mul_(scales.abs()/        y.sub_(self.q - 1).mul_(scales.abs()/'
FILE[5]=src/hhook/schedule/two_level.py;         SED[5]='s/            rows\[:width\].add_(rows\[width:2 \* width\])/            rows[:width].sub_(rows[width:2 * width])/'
for b in ${BREAKS:-1 2 3 4 5}; do
  D=/tmp/brk$b; rm -rf $D; mkdir -p $D
  (cd $SRC && git ls-files -z | xargs -0 cp --parents -t $D) 2>/dev/null
  before=$(md5sum < $D/${FILE[$b]})
  sed -i "${SED[$b]}" $D/${FILE[$b]}
  after=$(md5sum < $D/${FILE[$b]})
  if [ "$before" == "$after" ]; then echo "break $b: sed changed nothing" | tee $OUT/break$b.txt; continue; fi
  start=$(date +%s)
  (cd $D && PYTHONPATH=$D timeout 900 python3 -m pytest -q -p no:cacheprovider -x "$@" > $OUT/break$b.log 2>&1)
  rc=$?
  echo "break $b (${FILE[$b]}): rc=$rc in $(( $(date +%s) - start )) s; first failure: $(grep -m1 '^FAILED' $OUT/break$b.log)" | tee $OUT/break$b.txt
  rm -rf $D
done
