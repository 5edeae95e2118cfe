# Session 21, call 1: decode attention with RoPE + K/V write folded in (3deba1d). Full device
# suite (the fold's test and session 20's untested decode_long_contexts_cut_in_kernel); CB
# prompt 128 (W 16 / 64 / 256) A = two launches (PONDER_FOLD_ROPE_WRITE=0, = main) vs B = folded,
# alternated twice; prompt 2048 (W 16 / 64) A, B.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 170 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full device suite rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL|fold " /tmp/j/tests.log | head -40 >> $S
envof() { case $1 in A) echo "PONDER_FOLD_ROPE_WRITE=0";; B) echo "PONDER_FOLD_ROPE_WRITE=1";; esac; }
for i in 1 2; do
  for v in A B; do
    env $(envof $v) timeout 80 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb $v ($(envof $v)) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_${v}_$i.log | head -8 >> $S
  done
done
for i in 1; do
  for v in A B; do
    env $(envof $v) timeout 90 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_${v}_$i.json > /tmp/j/cb2k_${v}_$i.log 2>&1
    echo "== cb 2k $v ($(envof $v)) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_${v}_$i.log | head -6 >> $S
  done
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_fold_rope_write.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cp .device/call1.sh $OUT/r/call.sh
cat $S
