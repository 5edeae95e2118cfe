# Session 19, call 3: staged decode attention with cp.async from the producer warp. Decode attention
# tests; CB prompt 128: auto (cp.async, 4 x 16 KB), unstaged, 8 x 8 KB stages, bulk copies; prompt 2048
# auto and unstaged.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
timeout 100 .device/gpu_kernels --test-threads 1 decode_ cuda_graphs > /tmp/j/tests.log 2>&1
echo "== decode attention tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -20 >> $S
for v in auto unstaged s8k8; do
  E="PONDER_X=0"; A=auto
  [ $v = s8k8 ] && E="PONDER_STAGED_STAGES=8 PONDER_STAGED_STAGE_KB=8"
  [ $v = unstaged ] && A=unstaged
  env $E timeout 100 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --attention $A --commit $C --json /tmp/j/cb_${v}.json > /tmp/j/cb_${v}.log 2>&1
  echo "== cb $v ($E, --attention $A): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_${v}.log | head -8 >> $S
done
for v in auto unstaged; do
  timeout 110 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --attention $v --commit $C --json /tmp/j/cb2k_${v}.json > /tmp/j/cb2k_${v}.log 2>&1
  echo "== cb 2k $v: rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}.log | head -6 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_staged_cpasync.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
