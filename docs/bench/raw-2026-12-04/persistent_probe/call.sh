# Session 24, call 1: the persistent-kernel probe (384 projections at 16 rows, one cooperative
# launch with grid barriers vs a launch a phase vs barriers alone) beside cuBLAS (splitk_probe).
set -u
mkdir -p $OUT/r
cp .device/call1.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
git rev-parse HEAD >> $S
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/persistent_probe.cu -o /tmp/persistent >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
for i in 1 2; do
timeout 120 /tmp/persistent >> $S 2>&1
echo "== persistent $i rc $? t=$(( $(date +%s) - start ))s" >> $S
done
timeout 120 python3 tools/splitk_probe.py --rows 16,64 --json $OUT/r/splitk.json >> $S 2>&1
echo "== splitk rc $? t=$(( $(date +%s) - start ))s" >> $S
timeout 120 /tmp/persistent >> $S 2>&1
echo "== persistent 3 rc $? t=$(( $(date +%s) - start ))s" >> $S
cat $S
