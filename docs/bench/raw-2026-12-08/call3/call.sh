# Session 28, call 3: Auto takes the ring from 32 rows (4929672, "new") against c035156 ("mid":
# ring from 64 rows, folded) and 73ac059 ("old": no fold). CB prompt 128 W 24 ring forced vs
# Auto (SIMT there); W 32 new/mid; prompt 2048 W 64 new/old; 2048 W 32 new/mid; W 48 new/mid.
set -u
C=4929672
mkdir -p $OUT/r /tmp/j
cp .device/call3.sh $OUT/r/call.sh
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
bin() { case $1 in old*) echo .device/bench_looped_old;; mid*) echo .device/bench_looped_mid;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
for r in ring1 auto1 ring2 auto2; do
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 40 .device/bench_looped --suite cb --widths 24 --new-tokens 256 --commit $C --json /tmp/j/w24_$r.json > /tmp/j/w24_$r.log 2>&1
  echo "== cb W24 $r rc $? t=$(el)s" >> $S
  grep -E "^ +24 |rror|panic" /tmp/j/w24_$r.log | head -4 >> $S
done
for r in new1 mid1 new2 mid2; do
  timeout 40 $(bin $r) --suite cb --widths 32 --new-tokens 256 --commit $C --json /tmp/j/w32_$r.json > /tmp/j/w32_$r.log 2>&1
  echo "== cb W32 $r rc $? t=$(el)s" >> $S
  grep -E "^ +32 |rror|panic" /tmp/j/w32_$r.log | head -4 >> $S
done
save
for r in new1 old1 new2 old2; do
  timeout 100 $(bin $r) --suite cb --widths 64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k64_$r.json > /tmp/j/cb2k64_$r.log 2>&1
  echo "== cb 2k W64 $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |rror|panic" /tmp/j/cb2k64_$r.log | head -4 >> $S
done
save
for r in new1 mid1 new2 mid2; do
  [ $(el) -lt 430 ] || break
  timeout 60 $(bin $r) --suite cb --widths 32 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k32_$r.json > /tmp/j/cb2k32_$r.log 2>&1
  echo "== cb 2k W32 $r rc $? t=$(el)s" >> $S
  grep -E "^ +32 |rror|panic" /tmp/j/cb2k32_$r.log | head -4 >> $S
done
save
for r in new1 mid1 new2 mid2; do
  [ $(el) -lt 520 ] || break
  timeout 30 $(bin $r) --suite cb --widths 48 --new-tokens 256 --commit $C --json /tmp/j/w48_$r.json > /tmp/j/w48_$r.log 2>&1
  echo "== cb W48 $r rc $? t=$(el)s" >> $S
  grep -E "^ +48 |rror|panic" /tmp/j/w48_$r.log | head -4 >> $S
done
save
cat $S
