# Session 27, call 8: is the library's ring deterministic? attn_ring_probe relaunches it five times (after another shape wrote the
# workspace) and compares bits with the first launch; ctx 260 and the varied lengths (call 1 saw the rescale-skipping variant differ at W 64).
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call8.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/build.log 2>&1
echo "== build rc $? t=$(el)s" >> $S
for a in 260 var 1024; do
  timeout 100 /tmp/attn $a 16,64,256 brief > /tmp/j/attn_$a.log 2>&1
  echo "== attn $a rc $? t=$(el)s" >> $S
  grep -E "launched 5|rel err|rror|differs" /tmp/j/attn_$a.log >> $S
done
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
