# Session 24, call 6: ring probe, one case a process (a failing launch takes only its case down).
set -u
mkdir -p $OUT/r
cp .device/call6.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 60 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools tools/ring_probe.cu -o /tmp/ring >> $S 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> $S
for rep in 1 2; do
for i in 0 1 2 3 4 5 6 7 8 9 10 11; do
timeout 30 /tmp/ring $i 2>&1 | grep -v "^SMs" >> $S
done
echo "== rep $rep t=$(( $(date +%s) - start ))s" >> $S
done
timeout 90 compute-sanitizer --tool synccheck --print-limit 10 /tmp/ring sanitize > $OUT/r/synccheck.log 2>&1
echo "== synccheck rc $? t=$(( $(date +%s) - start ))s" >> $S
tail -12 $OUT/r/synccheck.log >> $S
cat $S
