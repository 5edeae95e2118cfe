# Session 18, call 2: attention splits short contexts and merges in the kernel (PONDER_ATTN_SPLIT_FROM,
# PONDER_ATTN_MERGE), against the old split-from-256 + merge launch, alternated (ABCABC) in one binary;
# the full device suite (and the attention tests again on the merge launch); L2 warming at 8 MB.
set -u
C=$(cat .device/commit 2>/dev/null || echo HEAD)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 150 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full device suite rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -30 >> $S
PONDER_ATTN_MERGE=launch timeout 90 .device/gpu_kernels --test-threads 1 decode_ prefill_ bidirectional block_causal head_dim cuda_graphs > /tmp/j/tests_merge_launch.log 2>&1
echo "== attention tests with the merge launch rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests_merge_launch.log | head -10 >> $S
for i in 1 2; do
  for v in old new mergeonly; do
    case $v in
      old) E="PONDER_ATTN_SPLIT_FROM=256 PONDER_ATTN_MERGE=launch" ;;
      new) E="PONDER_ATTN_SPLIT_FROM=128" ;;
      mergeonly) E="PONDER_ATTN_SPLIT_FROM=256" ;;
    esac
    env $E timeout 100 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb $v ($E) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |peak|bandwidth" /tmp/j/cb_${v}_$i.log >> $S
  done
done
PONDER_L2_WARM_MB=8 timeout 80 .device/bench_looped --suite cb --widths 16,64 --new-tokens 256 --commit $C --json /tmp/j/cb_new_warm8.json > /tmp/j/cb_new_warm8.log 2>&1
echo "== cb new + L2 warm 8 MB: rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(16|64|256) " /tmp/j/cb_new_warm8.log >> $S
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_attn_merge.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
