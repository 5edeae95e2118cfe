# Session 26, call 5: ncu full section set (with source counters and warp states) of one decode attention launch in a replayed CB step on main (3107341, bench_looped_old):
# the ring at W 64 and W 256, the SIMT kernel at W 16 (prompt 256 + 4 decode steps, as session 18's attention profile).
set -u
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
source .device/unpack.sh
B=.device/bench_looped_old
for spec in "64 paged_decode_ring_bf16" "256 paged_decode_ring_bf16" "16 paged_attn_bf16_d128_q1"; do
  set -- $spec; w=$1; k=$2
  timeout 150 ncu --profile-from-start off --graph-profiling node -k regex:$k -c 1 --set full --import-source no --section SourceCounters --section WarpStateStats -o /tmp/j/attn_w$w $B --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $O > /tmp/j/attn_w$w.log 2>&1
  echo "== ncu $k W $w rc $? t=$(( $(date +%s) - start ))s" >> $S
  ncu -i /tmp/j/attn_w$w.ncu-rep --page source --print-source sass --csv > /tmp/j/attn_w${w}_sass.csv 2>/dev/null
  ncu -i /tmp/j/attn_w$w.ncu-rep --page details > /tmp/j/attn_w${w}_details.txt 2>/dev/null
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Block Size|Waves Per SM|L2 Hit|Eligible|Issued Warp|No Eligible|Active Warps" /tmp/j/attn_w${w}_details.txt | head -30 >> $S
done
cd /tmp/j && xz -9 attn_w*_sass.csv && cp attn_w*_sass.csv.xz attn_w*_details.txt $OUT/r/ && tar cJf $OUT/r/logs.tar.xz *.log; cd - > /dev/null
cat $S
