# Session 23, call 3: skinny-M GEMM probe v2 (ping-pong register sets, per-shape timings) (tools/skinny_probe.cu, nvcc here) against cuBLAS
# (tools/splitk_probe.py) on the 384 projections of an Ouro-1.4B decode step; PDL with and without
# candle's allocation nodes.
set -u
mkdir -p $OUT/r
cp .device/call3.sh $OUT/r/call.sh
cp tools/skinny_probe.cu $OUT/r/
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $S
nvcc --version | tail -2 >> $S
timeout 120 nvcc -O3 -std=c++17 -arch=sm_90a tools/skinny_probe.cu -o /tmp/skinny >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
timeout 200 /tmp/skinny 16 32 64 > $OUT/r/skinny.log 2>&1
echo "== skinny rc $? t=$(( $(date +%s) - start ))s" >> $S
timeout 60 python3 tools/splitk_probe.py --rows 16 --json $OUT/r/splitk.json > $OUT/r/splitk.log 2>&1
echo "== splitk probe rc $? t=$(( $(date +%s) - start ))s" >> $S
cat $S $OUT/r/skinny.log; grep -E "384|rows  16 .*split 1|rows  64 .*split 1" $OUT/r/splitk.log
