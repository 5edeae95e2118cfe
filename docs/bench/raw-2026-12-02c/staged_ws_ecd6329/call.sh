# Session 19, call 2: the warp-specialised staged decode attention. Decode attention tests; CB prompt 128
# auto (4 stages x 16 KB), 4 x 32 KB, 8 x 16 KB, unstaged; prompt 2048 auto and unstaged.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
timeout 120 .device/gpu_kernels --test-threads 1 decode_ cuda_graphs > /tmp/j/tests.log 2>&1
echo "== decode attention tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -20 >> $S
for v in auto s4k32 s8k16 unstaged; do
  E="PONDER_X=0"; A=auto
  [ $v = s4k32 ] && E="PONDER_STAGED_STAGE_KB=32"
  [ $v = s8k16 ] && E="PONDER_STAGED_STAGES=8"
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
json.dump(out,open(os.environ['OUT']+'/r/ab_staged_ws.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
