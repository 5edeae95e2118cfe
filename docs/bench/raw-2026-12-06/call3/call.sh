# Session 26, call 3: where a CB decode step goes on main (3107341 = main's kernels after the session's reverts; bench_looped_old):
# ncu per-kernel durations of one replayed step at W 16 / 64 / 256 (prompt 256 + 4 decode steps, as session 18), and W 16 with 8192-token prompts.
set -u
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call3.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
source .device/unpack.sh
B=.device/bench_looped_old
for w in 16 64 256; do
  timeout 150 ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv $B --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $O > /tmp/j/step_w$w.csv 2> /tmp/j/step_w$w.err
  echo "== ncu step W $w rc $? t=$(el)s" >> $S
  tail -3 /tmp/j/step_w$w.err >> $S
done
[ $(el) -lt 400 ] && { timeout 120 $B --suite cb --widths 16 --prompt-len 8192 --new-tokens 64 --repeats 1 --commit $O --json /tmp/j/cb8k.json > /tmp/j/cb8k.log 2>&1
  echo "== cb 8k W 16 rc $? t=$(el)s" >> $S; grep -E "^ +16 |rror|panic" /tmp/j/cb8k.log >> $S; cp /tmp/j/cb8k.json $OUT/r/; }
cd /tmp/j && xz -9 step_w*.csv && cp step_w*.csv.xz $OUT/r/ && tar cJf $OUT/r/logs.tar.xz *.err *.log 2>/dev/null; cd - >/dev/null
cat $S
