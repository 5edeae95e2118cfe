# Session 24, call 13: decode attention through the bulk-copy ring (568112e) in the library.
# Device tests decode_ (incl. decode_ring_kernel); CB prompt 128 (W 16 / 64 / 256) ring on / off
# alternated twice (PONDER_DECODE_RING=0 = off, one binary); prompt 2048 and depth batching W 64
# on / off if time is left.
set -u
C=568112e
mkdir -p $OUT/r /tmp/j
cp .device/call13.sh $OUT/r/call.sh
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
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 110 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|ring" /tmp/j/tests.log | head -30 >> $S
save
for r in on1 off1 on2 off2; do
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 75 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in on off; do
  [ $(el) -lt 215 ] || break
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 60 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
for r in on off; do
  [ $(el) -lt 290 ] || break
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 30 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
  save
done
cat $S
