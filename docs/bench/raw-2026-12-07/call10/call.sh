# Session 27, call 10: the full device test suite on 73ac059 (the ring's one-wave combine; later commits are docs and tools).
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call10.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
source .device/unpack.sh
timeout 420 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== gpu_kernels (all) rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|^test " /tmp/j/tests.log | head -60 >> $S
cp /tmp/j/tests.log $OUT/r/
cat $S
