# Session 28, call 2: the folded ring (c035156) against 73ac059, alternated: depth batching W 64
# (shared, last-exited), CB prompt 2048 W 16 / 64; then the ring forced vs Auto (new binary) at
# CB W 32 prompt 128 and W 16 prompt 2048 (does the fold move the ring's threshold?).
set -u
C=c035156
mkdir -p $OUT/r /tmp/j
cp .device/call2.sh $OUT/r/call.sh
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
bin() { case $1 in old*) echo .device/bench_looped_old;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
for lay in shared last-exited; do
  for r in new1 old1 new2 old2; do
    timeout 40 $(bin $r) --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout $lay --time-device --commit $C --json /tmp/j/cdb_${lay}_$r.json > /tmp/j/cdb_${lay}_$r.log 2>&1
    echo "== cdb $lay $r rc $? t=$(el)s" >> $S
    grep -E "^ +64 |roofline|device time|rror|panic" /tmp/j/cdb_${lay}_$r.log | head -12 >> $S
  done
  save
done
for r in new1 old1 new2 old2; do
  timeout 50 $(bin $r) --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
done
save
for r in ring1 auto1 ring2 auto2; do
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 30 .device/bench_looped --suite cb --widths 32 --new-tokens 256 --commit $C --json /tmp/j/w32_$r.json > /tmp/j/w32_$r.log 2>&1
  echo "== cb W32 $r rc $? t=$(el)s" >> $S
  grep -E "^ +32 |rror|panic" /tmp/j/w32_$r.log | head -4 >> $S
done
save
for r in ring1 auto1 ring2 auto2; do
  [ $(el) -lt 480 ] || break
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 40 .device/bench_looped --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/w16k_$r.json > /tmp/j/w16k_$r.log 2>&1
  echo "== cb 2k W16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/w16k_$r.log | head -4 >> $S
done
save
cat $S
