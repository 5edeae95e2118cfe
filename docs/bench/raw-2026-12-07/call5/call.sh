# Session 27, call 5: what in the kernel before attention slows the ring: K/V store width, K/V written elsewhere (scratch, the next layer), and the library's qkv_rope_write itself as the predecessor.
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/build.log 2>&1
echo "== build rc $? t=$(el)s" >> $S
for a in 260 var; do
  timeout 100 /tmp/attn $a 16,64,256 brief > /tmp/j/attn_$a.log 2>&1
  echo "== attn $a rc $? t=$(el)s" >> $S
  grep -E "us a launch|rror|DIFF|PDL|identical|not timed" /tmp/j/attn_$a.log | sort -s -k1,2 | uniq >> $S
done
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
