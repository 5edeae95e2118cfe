# Session 18, call 3: where a CB decode step's time goes now, at the bench's mean context (prompt 256
# + 4 decode steps): ncu per-kernel durations of one replayed step at W 16 / 64 / 256, and a full
# ncu section set (with source counters) of the attention kernel at W 64 and W 256.
set -u
C=$(cat .device/commit 2>/dev/null || echo HEAD)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
for w in 16 64 256; do
  timeout 150 ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv .device/bench_looped --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $C > /tmp/j/step_w$w.csv 2> /tmp/j/step_w$w.err
  echo "== ncu step W $w rc $? t=$(( $(date +%s) - start ))s" >> $S
done
for w in 64 256; do
  timeout 120 ncu --profile-from-start off --graph-profiling node -k regex:paged_attn -c 1 --set full --import-source no --section SourceCounters --section WarpStateStats -o /tmp/j/attn_w$w .device/bench_looped --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $C > /tmp/j/attn_w$w.log 2>&1
  echo "== ncu attention W $w rc $? t=$(( $(date +%s) - start ))s" >> $S
  ncu -i /tmp/j/attn_w$w.ncu-rep --page details --csv > /tmp/j/attn_w${w}_details.csv 2>/dev/null
  ncu -i /tmp/j/attn_w$w.ncu-rep --page source --print-source sass --csv > /tmp/j/attn_w${w}_sass.csv 2>/dev/null
  ncu -i /tmp/j/attn_w$w.ncu-rep --page details > /tmp/j/attn_w${w}_details.txt 2>/dev/null
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Block Size|Waves Per SM|L2 Hit|Eligible|Issued Warp" /tmp/j/attn_w${w}_details.txt | head -30 >> $S
done
cd /tmp/j && xz -9 step_w*.csv attn_w*_sass.csv attn_w*_details.csv && cd - > /dev/null
tar cf $OUT/r/ncu.tar -C /tmp/j $(cd /tmp/j && ls *.xz *.txt *.log *.err 2>/dev/null)
ls -la /tmp/j >> $S
cat $S
