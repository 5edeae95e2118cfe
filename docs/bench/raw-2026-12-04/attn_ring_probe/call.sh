# Session 24, call 12: decode attention through a bulk-copy ring vs the library's kernel.
set -u
mkdir -p $OUT/r
cp .device/call12.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 90 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools tools/attn_ring_probe.cu -o /tmp/attn >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
timeout 150 /tmp/attn 260 >> $S 2>&1
echo "== attn 260 rc $? t=$(( $(date +%s) - start ))s" >> $S
timeout 150 /tmp/attn 2300 16,64 >> $S 2>&1
echo "== attn 2300 rc $? t=$(( $(date +%s) - start ))s" >> $S
cat $S
