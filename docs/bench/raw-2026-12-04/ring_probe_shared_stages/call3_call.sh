# Session 24, call 3: ring probe ablations; the racy run's launch failure under compute-sanitizer.
set -u
mkdir -p $OUT/r
cp .device/call3.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools tools/ring_probe.cu -o /tmp/ring >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
for i in 1 2; do
timeout 100 /tmp/ring >> $S 2>&1
echo "== ring $i rc $? t=$(( $(date +%s) - start ))s" >> $S
done
timeout 200 compute-sanitizer --tool memcheck --print-limit 10 /tmp/ring sanitize > $OUT/r/sanitize.log 2>&1
echo "== sanitize rc $? t=$(( $(date +%s) - start ))s" >> $S
tail -30 $OUT/r/sanitize.log >> $S
cat $S
