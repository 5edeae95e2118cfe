# Session 28, call 1: Ouro's layer on ops::qkv_rope_attention (the folded ring, c035156).
# Device tests: the folded op, the ring (second launch same bits), Ouro end to end on the folded
# ring vs SIMT, graphs vs eager. Then, if green: CB prompt 128 W 16/64/256 new/old alternated
# (old = 73ac059), W 16 with the ring forced (new) vs default, depth batching W 64 new/old.
set -u
C=c035156
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
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
timeout 240 .device/gpu_kernels --test-threads 1 --nocapture fused_qkv_rope_attention decode_ring_kernel ouro_decode_on_the_folded_ring cuda_graphs_match_eager > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|folded ring|qkv_rope_attention|identical" /tmp/j/tests.log | head -40 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for r in new1 old1 new2 old2; do
  b=.device/bench_looped; case $r in old*) b=.device/bench_looped_old;; esac
  timeout 75 $b --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in ring1 auto1 ring2 auto2; do
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 40 .device/bench_looped --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/w16_$r.json > /tmp/j/w16_$r.log 2>&1
  echo "== cb W16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/w16_$r.log | head -4 >> $S
  save
done
for r in new old; do
  [ $(el) -lt 400 ] || break
  b=.device/bench_looped; case $r in old*) b=.device/bench_looped_old;; esac
  timeout 40 $b --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
  save
done
cat $S
