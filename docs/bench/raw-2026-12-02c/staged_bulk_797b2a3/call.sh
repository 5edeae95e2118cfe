# Session 19, call 1: the staged decode attention kernel (797b2a3). Full device suite; CB at prompt 128
# (W 16 / 64 / 256) and 2048 (W 16 / 64), --attention auto (staged) and unstaged (register-load) alternated.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 170 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full device suite rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -30 >> $S
grep -E "decode (rows without|mha 55|gqa 32/4|300 rows)" /tmp/j/tests.log | head -12 >> $S
for i in 1 2; do
  for v in auto unstaged; do
    timeout 100 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --attention $v --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb $v run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_${v}_$i.log | head -8 >> $S
  done
done
for v in auto unstaged; do
  timeout 110 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --attention $v --commit $C --json /tmp/j/cb2k_${v}.json > /tmp/j/cb2k_${v}.log 2>&1
  echo "== cb 2k $v: rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}.log | head -6 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_staged.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
