# Session 30, call 5: the 8-warp build held to 4 blocks an SM (fada648). Its tests; then CB W 24 and W 32 (both the 32-row graph
# bucket) with PONDER_DECODE_RING=0 (the SIMT fold: now the _w8o4 build) against the default (the folded ring), alternated twice.
set -u
C=fada648
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
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
timeout 150 .device/gpu_kernels --test-threads 1 --nocapture decode_eight decode_mha fused_qkv_rope_attention_simt > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked|32 rows" /tmp/j/tests.log | head -30 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for w in 24 32; do
  for r in simt1 ring1 simt2 ring2; do
    case $r in simt*) E="env PONDER_DECODE_RING=0";; *) E=env;; esac
    timeout 40 $E .device/bench_looped --suite cb --widths $w --new-tokens 256 --commit $C --json /tmp/j/cb${w}_$r.json > /tmp/j/cb${w}_$r.log 2>&1
    echo "== cb W $w $r rc $? t=$(el)s" >> $S
    grep -E "^ +$w |rror|panic" /tmp/j/cb${w}_$r.log | head -3 >> $S
  done
done
save
cat $S
