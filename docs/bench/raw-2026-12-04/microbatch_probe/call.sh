# Session 24, call 11: micro-batches on parallel streams (tools/microbatch_probe.py).
set -u
mkdir -p $OUT/r
cp .device/call11.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 python3 tools/microbatch_probe.py --rows 16,64,256 --json $OUT/r/microbatch.json >> $S 2>&1
echo "== microbatch rc $? t=$(( $(date +%s) - start ))s" >> $S
cat $S
