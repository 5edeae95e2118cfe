# Session 22, call 1 (fe24a8c = 51ff4aa again): folded RoPE + K/V write and the cluster split
# merge. Decode attention tests with the cluster merge on (then off if that fails), then CB
# prompt 128 (W 16 / 64 / 256) A = neither (= main), D = both, C = cluster only, B = fold only,
# A, D again; prompt 2048 (W 16 / 64) A, D. First a PyTorch probe of split-K projections
# (tools/splitk_probe.py). Results saved after every run.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_fold_cluster.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 120 python3 .device/splitk_probe.py --rows 16,64 --json $OUT/r/splitk_probe.json > /tmp/j/splitk_probe.log 2>&1
echo "== split-K probe rc $? t=$(( $(date +%s) - start ))s" >> $S
cat /tmp/j/splitk_probe.log | tail -50 >> $S
timeout 130 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests_cluster.log 2>&1
rc=$?
echo "== decode tests (cluster merge on) rc $rc t=$(( $(date +%s) - start ))s" >> $S
grep -E "^test |test result|FAILED|panicked|differ" /tmp/j/tests_cluster.log | head -40 >> $S
save
if [ $rc -ne 0 ]; then
  PONDER_CLUSTER_MERGE=0 timeout 100 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests_nocluster.log 2>&1
  rc2=$?
  echo "== decode tests (cluster merge off) rc $rc2 t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^test |test result|FAILED|panicked|differ" /tmp/j/tests_nocluster.log | head -40 >> $S
  save
fi
envof() { case $1 in A) echo "PONDER_FOLD_ROPE_WRITE=0 PONDER_CLUSTER_MERGE=0";; B) echo "PONDER_CLUSTER_MERGE=0";; C) echo "PONDER_FOLD_ROPE_WRITE=0";; D) echo "PONDER_X=0";; esac; }
RUNS="A1 D1 C1 B1 A2 D2"; L=D
[ $rc -eq 0 ] || { RUNS="A1 B1 A2 B2"; L=B; }
for r in $RUNS; do
  v=${r%?}; i=${r#?}
  env $(envof $v) timeout 60 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
  echo "== cb $v ($(envof $v)) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_${v}_$i.log | head -8 >> $S
  save
done
for v in A $L; do
  env $(envof $v) timeout 80 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_${v}.json > /tmp/j/cb2k_${v}.log 2>&1
  echo "== cb 2k $v ($(envof $v)): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}.log | head -6 >> $S
  save
done
cat $S
