# Session 24, call 7: where the ring probe's launch without barriers fails (case 6: stream only).
set -u
mkdir -p $OUT/r
cp .device/call7.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools tools/ring_probe.cu -o /tmp/ring >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
which cuda-gdb >> $S 2>&1
timeout 120 cuda-gdb -batch -ex "set cuda api_failures ignore" -ex run -ex "info cuda kernels" -ex bt -ex "x/4i \$pc" -ex "info cuda warps" --args /tmp/ring 6 > $OUT/r/gdb.log 2>&1
echo "== gdb rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -v "^\[New Thread\|^\[Thread" $OUT/r/gdb.log | head -60 >> $S
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 /tmp/ring 6 > $OUT/r/memcheck.log 2>&1
echo "== memcheck rc $? t=$(( $(date +%s) - start ))s" >> $S
tail -40 $OUT/r/memcheck.log >> $S
cat $S
