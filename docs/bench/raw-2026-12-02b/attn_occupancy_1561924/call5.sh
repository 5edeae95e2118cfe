# Session 18, call 5: the full device suite of the 7-blocks attention build (1561924).
set -u
mkdir -p $OUT/r
source .device/unpack.sh
timeout 200 .device/gpu_kernels --test-threads 1 > $OUT/r/gpu_kernels_1561924.txt 2>&1
echo "== full gpu_kernels at 1561924 rc $?" > $OUT/r/summary.txt
grep -E "test result|FAILED|panicked" $OUT/r/gpu_kernels_1561924.txt >> $OUT/r/summary.txt
cat $OUT/r/summary.txt
