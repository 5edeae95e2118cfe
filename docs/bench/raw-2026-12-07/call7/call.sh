# Session 27, call 7: a timeline of one ring launch (attn_ring_probe.cu built with -DRING_TIMELINE: globaltimer stamps per block at the
# ring's RING_MARK points, the last of 96 chained launches), ctx 260, the varied lengths, ctx 1024.
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call7.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -DRING_TIMELINE -Itools tools/attn_ring_probe.cu -o /tmp/attn_tl > /tmp/j/build.log 2>&1
echo "== build rc $? t=$(el)s" >> $S
for a in 260 var 1024; do
  timeout 100 /tmp/attn_tl $a 16,64,256 brief > /tmp/j/attn_$a.log 2>&1
  echo "== attn $a rc $? t=$(el)s" >> $S
  grep -E "timeline|^W +[0-9]+   |ring \(equal|combine alone|ring without|rror|differs" /tmp/j/attn_$a.log | awk '!seen[$0]++' >> $S
done
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
