# Session 26, call 6: the decode ring's consumers without per-position guards on full stages (c3761f3) against main (3107341, bench_looped_old).
# tests decode_; attn_ring_probe 260 at W 64 / 256; CB prompt 128 W 64 / 256 new/old alternated twice; depth batching W 64 shared new/old.
set -u
C=c3761f3
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call6.sh $OUT/r/call.sh
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
source .device/gpu-env.sh 2>/dev/null || true
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/probe_build.log 2>&1 &
source .device/unpack.sh
timeout 110 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests.log | head -10 >> $S
wait
timeout 30 /tmp/attn 260 64,256 > /tmp/j/probe_260.log 2>&1; echo "== probe 260 rc $? t=$(el)s" >> $S
grep -E "library|ring \(equal|rel err" /tmp/j/probe_260.log | grep -v "ring, " | head -14 >> $S
save
for r in new1 old1 new2 old2; do
  [ $(el) -lt 300 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 75 $bin --suite cb --widths 64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in new old; do
  [ $(el) -lt 330 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 30 $bin --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $c --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -6 >> $S
  save
done
cat $S
