# Session 30, call 2: the 8-warp SIMT build for one-wave decode launches (2d78dc2, "new") against f62a3ae ("old").
# Decode / fold / graph / Ouro tests; CB W 16 new/old alternated twice; prompt 2048 W 16 new/old twice; depth batching W 64 new/old.
set -u
C=2d78dc2
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
timeout 200 .device/gpu_kernels --test-threads 1 --nocapture decode_ fused_qkv_rope_attention cuda_graphs_match_eager ouro_decode_on_the_folded > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked|8-warp|folded, output" /tmp/j/tests.log | head -80 >> $S
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
for r in new1 old1 new2 old2; do
  [ $(el) -lt 500 ] || break
  timeout 40 $(bin $r) --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb W 64 $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|device time|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
done
save
cat $S
