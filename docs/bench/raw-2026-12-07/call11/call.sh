# Session 27, call 11: the ring with qkv_rope_write's work folded in (paged_decode_ring_impl<T, true>, the probe's ring_rope_bf16) against
# qkv_rope_write + the library's ring: output and newest K/V checked, per-link time; ctx 260 and the varied lengths.
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call11.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/build.log 2>&1
echo "== build rc $? t=$(el)s" >> $S
for a in 260 var 1024; do
  timeout 100 /tmp/attn $a 16,64,256 brief > /tmp/j/attn_$a.log 2>&1
  echo "== attn $a rc $? t=$(el)s" >> $S
  grep -E "folded|qkv_rope_write|ring \(equal|rror|differs|DIFF" /tmp/j/attn_$a.log | awk '!seen[$0]++' >> $S
done
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
