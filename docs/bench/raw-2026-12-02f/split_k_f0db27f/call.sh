# Session 22, call 2 (f0db27f): decode projections split over k (ops::split_k). Device tests
# (split-K, fused norms, graphs vs eager for Ouro and Huginn), then one binary A/B:
# A = PONDER_SPLIT_K=0 (never split = main), B = default (4 slices at <= 64 rows).
# CB prompt 128 (W 16 / 64 / 256) A B A B; prompt 2048 (W 16 / 64) A B; Huginn CB (W 16 / 64,
# 128 new) A B; depth batching (W 64, mean depth 2.5, refill, shared K/V) A B. Saved after every run.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call2.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_split_k.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 150 .device/gpu_kernels --test-threads 1 split_k fused_ cuda_graphs huginn_stage > /tmp/j/tests.log 2>&1
echo "== device tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^test |test result|FAILED|panicked|split-K" /tmp/j/tests.log | head -50 >> $S
save
envof() { case $1 in A) echo "PONDER_SPLIT_K=0";; B) echo "PONDER_X=0";; esac; }
for r in A1 B1 A2 B2; do
  v=${r%?}; i=${r#?}
  env $(envof $v) timeout 60 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
  echo "== cb $v ($(envof $v)) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_${v}_$i.log | head -8 >> $S
  save
done
for v in A B; do
  env $(envof $v) timeout 80 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_${v}.json > /tmp/j/cb2k_${v}.log 2>&1
  echo "== cb 2k $v ($(envof $v)): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}.log | head -6 >> $S
  save
done
for v in A B; do
  env $(envof $v) timeout 90 .device/bench_looped --model huginn --suite cb --widths 16,64 --new-tokens 128 --repeats 1 --commit $C --json /tmp/j/huginn_${v}.json > /tmp/j/huginn_${v}.log 2>&1
  echo "== huginn cb $v ($(envof $v)): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/huginn_${v}.log | head -6 >> $S
  save
done
for v in A B; do
  env $(envof $v) timeout 90 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --time-device --commit $C --json /tmp/j/cdb_${v}.json > /tmp/j/cdb_${v}.log 2>&1
  echo "== cdb shared $v ($(envof $v)): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_${v}.log | head -12 >> $S
  save
done
cat $S
