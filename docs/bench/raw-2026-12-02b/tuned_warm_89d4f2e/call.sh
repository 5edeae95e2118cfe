# Session 18, call 1: the tuned cuBLASLt projections (PONDER_DECODE_GEMM) and L2 warming of the next
# projection's weight (PONDER_L2_WARM_MB), each on/off, alternated twice in one binary (ABCDABCD).
set -u
C=$(cat .device/commit 2>/dev/null || echo HEAD)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 240 .device/gpu_kernels --test-threads 1 tuned_linear fused_ cuda_graphs_match_eager > /tmp/j/tests.log 2>&1
echo "== focused tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|tuned_linear .* rel err" /tmp/j/tests.log | head -30 >> $S
for i in 1 2; do
  for g in cublas lt; do
    for w in 0 32; do
      E="PONDER_L2_WARM_MB=$w"; [ $g = cublas ] && E="$E PONDER_DECODE_GEMM=cublas"
      env $E timeout 110 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${g}_warm${w}_$i.json > /tmp/j/cb_${g}_warm${w}_$i.log 2>&1
      echo "== cb gemm $g warm $w MB, run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
      grep -E "^ +(16|64|256) |peak|bandwidth" /tmp/j/cb_${g}_warm${w}_$i.log >> $S
    done
  done
done
grep "tuned GEMM" /tmp/j/cb_lt_warm0_1.log >> $S
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_tuned_warm.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
