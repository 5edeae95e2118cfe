# Session 29, call 1: the full gpu_kernels at main (ebd9a0d: code after session 28's call 5 never ran on the device),
# then ncu per-kernel durations of one replayed CB step at W 16 / 64 / 256, prompt 128, with warm L2 and boost clocks
# (--cache-control none --clock-control none: what the kernels cost inside the graph, minus the overlap), and CB once.
set -u
C=ebd9a0d
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 170 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|failed" /tmp/j/tests.log | head -20 >> $S
B=.device/bench_looped
for w in 16 64 256; do
  timeout 100 ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv $B --suite cb --widths $w --prompt-len 128 --new-tokens 16 --repeats 1 --profile-step --commit $C > /tmp/j/step_w$w.csv 2> /tmp/j/step_w$w.err
  echo "== ncu warm step W $w rc $? t=$(el)s" >> $S
  tail -2 /tmp/j/step_w$w.err >> $S
done
timeout 60 $B --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb.json > /tmp/j/cb.log 2>&1
echo "== cb rc $? t=$(el)s" >> $S
grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb.log >> $S
cd /tmp/j && xz -9 step_w*.csv && cp step_w*.csv.xz cb.json $OUT/r/ && tar cJf $OUT/r/logs.tar.xz *.err *.log 2>/dev/null; cd - >/dev/null
cat $S
