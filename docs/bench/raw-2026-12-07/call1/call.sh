# Session 27, call 1: the ring's prepared variants in attn_ring_probe.cu (main 4482d5d): one head a consumer warp (17 warps),
# rescale only when the running maximum grows (bit-identity checked); even contexts (260) and the depth-batching lengths (var).
set -u
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 200 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/build.log 2>&1
echo "== build rc $? t=$(el)s" >> $S
for a in 260 var; do
  timeout 150 /tmp/attn $a 16,64,256 > /tmp/j/attn_$a.log 2>&1
  echo "== attn $a rc $? t=$(el)s" >> $S
  cat /tmp/j/attn_$a.log >> $S
done
cp /tmp/j/*.log $OUT/r/
cat $S
