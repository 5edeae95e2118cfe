# Session 27, call 9: the ring's combine as one wave merging only the rows the ring cut (73ac059, bench_looped / gpu_kernels) against main
# before it (4dec06d, bench_looped_old; kernels unchanged since): device tests decode_ + graphs; attn_ring_probe 260 brief; CB prompt 128
# W 16 / 64 / 256 old/new alternated twice; W 16 with the ring forced (PONDER_DECODE_RING=1) against the SIMT path, new binary, twice;
# depth batching W 64 shared old/new.
set -u
C=73ac059
O=4dec06d
mkdir -p $OUT/r /tmp/j
cp .device/call9.sh $OUT/r/call.sh
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
source .device/unpack.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
(timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/build.log 2>&1) &
P=$!
timeout 120 .device/gpu_kernels --test-threads 1 decode_ cuda_graphs > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests.log | head -20 >> $S
wait $P
save
for r in old1 new1 old2 new2; do
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 100 $bin --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in simt1 ring1 simt2 ring2; do
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 60 .device/bench_looped --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/cb16_$r.json > /tmp/j/cb16_$r.log 2>&1
  echo "== cb W16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb16_$r.log | head -3 >> $S
done
save
timeout 60 /tmp/attn 260 16,64,256 brief > /tmp/j/attn_260.log 2>&1
echo "== probe t=$(el)s" >> $S
grep -E "combine alone|library, its plan  |ring \(equal|rror|differs" /tmp/j/attn_260.log | sort | uniq >> $S
for r in old new; do
  [ $(el) -lt 400 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 60 $bin --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $c --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb shared $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -6 >> $S
  save
done
cat $S
