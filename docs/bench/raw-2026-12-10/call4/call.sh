# Session 30, call 4: the 16-warp SIMT build for one-wave launches of two blocks an SM (a704157, "new") against 2d78dc2 ("old", the 8-warp build only).
# Decode / fold / graph / Ouro tests; CB W 16 new/old alternated twice; prompt 2048 W 16 new/old twice; CB W 16 / 64 / 256 new once (standing).
set -u
C=a704157
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
bin() { case $1 in old*) echo .device/bench_looped_old;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 .device/gpu_kernels --test-threads 1 --nocapture decode_ fused_qkv_rope_attention cuda_graphs_match_eager ouro_decode_on_the_folded > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked|wide builds|folded, output" /tmp/j/tests.log | head -80 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for r in new1 old1 new2 old2; do
  timeout 30 $(bin $r) --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb_$r.log | head -4 >> $S
done
save
for r in new1 old1 new2 old2; do
  [ $(el) -lt 420 ] || break
  timeout 40 $(bin $r) --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb2k_$r.log | head -4 >> $S
done
save
timeout 150 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb3_new.json > /tmp/j/cb3_new.log 2>&1
echo "== cb W 16/64/256 new rc $? t=$(el)s" >> $S
grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb3_new.log | head -6 >> $S
save
cat $S
