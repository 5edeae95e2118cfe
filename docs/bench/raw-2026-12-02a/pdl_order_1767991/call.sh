# Session 17, call 3 (ABCABC): why PDL lost. off = captured chain; on = programmatic edges; order = the gates'
# restructured dependencies with ordinary edges (is the DAG or the programmatic launch the cost?). Also checks the copy
# bandwidth fix (7adb...): bench_looped prints it.
set -u
C=$(cat .device/commit 2>/dev/null || echo HEAD)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
for i in 1 2; do
  for v in off on order; do
    E="PONDER_PDL=$v"; [ $v = on ] && E="PONDER_PDL=1"; [ $v = off ] && E="PONDER_PDL=0"
    env $E timeout 100 .device/bench_looped --suite cb --widths 16,64 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb pdl $v $i rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |programmatic|peak|bandwidth" /tmp/j/cb_${v}_$i.log >> $S
  done
done
PONDER_PDL=0 timeout 100 .device/bench_looped --suite cb --widths 256 --new-tokens 256 --commit $C --json /tmp/j/cb_off_w256.json > /tmp/j/cb_off_w256.log 2>&1
echo "== cb off W256 rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(16|64|256) |peak|bandwidth" /tmp/j/cb_off_w256.log >> $S
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_pdl_order.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
