# Session 24, call 2: the ring probe (persistent projections fed by a producer warp's bulk copies).
set -u
mkdir -p $OUT/r
cp .device/call2.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/ring_probe.cu -o /tmp/ring >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
for i in 1 2; do
timeout 100 /tmp/ring >> $S 2>&1
echo "== ring $i rc $? t=$(( $(date +%s) - start ))s" >> $S
done
cat $S
