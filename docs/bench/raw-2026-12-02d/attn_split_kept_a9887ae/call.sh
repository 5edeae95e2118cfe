# Session 20, call 4: the kept split plan (a9887ae): chunks of the context bound while ≤ 512 keys,
# the kernel cuts the actual longest context beyond; 7-block build by keys per block. Decode
# attention tests; CB prompt 128 (W 16 / 64 / 256) A = the plan before this session
# (PONDER_ATTN_SPLIT=bucket PONDER_ATTN_OCC=6) and N = the new default, alternated; prompt 2048
# (W 16 / 64) N once (A in calls 1-3 of this session).
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
timeout 40 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== decode tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked|^test .*FAIL" /tmp/j/tests.log | head -30 >> $S
envof() { case $1 in A) echo "PONDER_ATTN_SPLIT=bucket PONDER_ATTN_OCC=6";; N) echo "PONDER_X=0";; esac; }
cb() {
  env $(envof $1) timeout 60 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_$1_$2.json > /tmp/j/cb_$1_$2.log 2>&1
  echo "== cb $1 ($(envof $1)) run $2: rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$1_$2.log | head -8 >> $S
  cp /tmp/j/cb_$1_$2.json $OUT/r/
}
cb A 1; cb N 1
timeout 70 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json $OUT/r/cb2k_N.json > /tmp/j/cb2k_N.log 2>&1
echo "== cb 2k N: rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb2k_N.log | head -6 >> $S
cb A 2; cb N 2
cp .device/call4.sh $OUT/r/call.sh
cat $S
