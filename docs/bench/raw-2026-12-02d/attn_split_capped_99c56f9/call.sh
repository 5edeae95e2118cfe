# Session 20, call 3: the split plan capped at 8 blocks an SM (99c56f9). Decode attention tests; CB
# prompt 128 (W 16 / 64 / 256) with A = bucket splits + 6 blocks (= main before this session) and
# D = actual splits by the wave model (block cost one step, at most 8 blocks an SM), occupancy by
# keys (the default), alternated twice; prompt 2048 (W 16 / 64) A, D once.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 60 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== decode tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -30 >> $S
envof() { case $1 in A) echo "PONDER_ATTN_SPLIT=bucket PONDER_ATTN_OCC=6";; D) echo "PONDER_X=0";; E) echo "PONDER_ATTN_C0=256";; esac; }
for i in 1 2; do
  for v in A D; do
    env $(envof $v) timeout 80 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb $v ($(envof $v)) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_${v}_$i.log | head -8 >> $S
  done
done
for v in A D; do
  env $(envof $v) timeout 90 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_${v}.json > /tmp/j/cb2k_${v}.log 2>&1
  echo "== cb 2k $v ($(envof $v)): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}.log | head -6 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_attn_split_capped.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cp .device/call3.sh $OUT/r/call.sh
cat $S
