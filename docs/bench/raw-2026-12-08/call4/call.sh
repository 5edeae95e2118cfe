# Session 28, call 4: the full gpu_kernels suite at 7836c20 (Ouro on the folded ring, ring from
# 32 rows), then depth batching W 64 shared: 4929672 ("new", ring from 32 rows) against c035156
# ("mid", ring from 64 rows), alternated twice.
set -u
C=4929672
mkdir -p $OUT/r /tmp/j
cp .device/call4.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
bin() { case $1 in mid*) echo .device/bench_looped_mid;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 300 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== gpu_kernels (all) rc $? t=$(el)s" >> $S
grep -E "^test |test result|panicked" /tmp/j/tests.log | head -60 >> $S
save
for r in new1 mid1 new2 mid2; do
  [ $(el) -lt 480 ] || break
  timeout 40 $(bin $r) --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_shared_$r.json > /tmp/j/cdb_shared_$r.log 2>&1
  echo "== cdb shared $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|device time|rror|panic" /tmp/j/cdb_shared_$r.log | head -12 >> $S
done
save
cat $S
