# Session 29, call 4: the full gpu_kernels at main (94a3ef3: the row norms' change, the merge reverted), then ncu
# warm per-kernel durations (--cache-control none --clock-control none) of one replayed CB step at the benchmark's
# mean context (prompt 256 + 16 new) at W 16 / 64 / 256, for main ("new") and session 28's main ebd9a0d ("old").
set -u
C=94a3ef3
mkdir -p $OUT/r /tmp/j
cp .device/call4.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|failed" /tmp/j/tests.log | head -20 >> $S
for v in new old; do
  case $v in old) B=.device/bench_looped_old; O=ebd9a0d;; *) B=.device/bench_looped; O=$C;; esac
  for w in 16 64 256; do
    [ $(el) -lt 400 ] || break
    timeout 60 ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv $B --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $O > /tmp/j/step_${v}_w$w.csv 2> /tmp/j/step_${v}_w$w.err
    echo "== ncu warm step $v W $w rc $? t=$(el)s" >> $S
  done
done
cd /tmp/j && tar cJf $OUT/r/steps.tar.xz step_*.csv && tar cJf $OUT/r/logs.tar.xz *.err *.log 2>/dev/null; cd - >/dev/null
cat $S
