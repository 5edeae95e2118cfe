# Session 25, call 5: was call 4's first run (cdb shared, ring on, timeout 40 s) a hang or the
# driver's first-run PTX JIT on a fresh machine? The same run cold with a long timeout, then warm.
set -u
C=80395e4
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
for n in cold warm; do
  timeout 150 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/$n.json > /tmp/j/$n.log 2>&1
  echo "== $n rc $? t=$(el)s" >> $S
  grep -E "^ +64 |random weights|roofline|rror|panic" /tmp/j/$n.log | head -8 >> $S
  [ $(el) -lt 120 ] || break
done
cp /tmp/j/*.log $OUT/r/
cat $S
