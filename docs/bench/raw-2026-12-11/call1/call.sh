# Session 31, call 1 (f9c4014): full gpu_kernels (3b5ff8e / f9c4014 never ran on the device); the probe's wide mode at
# W 5-8 (one block an SM), 8192 / 4096 keys, W 64 (ring vs 8-warp in one run); CB W 24 / 32 at prompt 2048, SIMT fold vs ring.
set -u
C=f9c4014
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
( timeout 150 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/nvcc.log 2>&1; echo "nvcc rc $?" >> /tmp/j/nvcc.log ) &
NV=$!
timeout 200 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|panicked|FAILED|failed" /tmp/j/tests.log | head -20 >> $S
wait $NV; tail -2 /tmp/j/nvcc.log >> $S
save
for a in "260 5,6,8" "260 64" "4096 16" "8192 8,16"; do
  f=/tmp/j/probe_$(echo $a | tr ' ,' '__').log
  timeout 60 /tmp/attn $a wide > $f 2>&1
  echo "== probe $a rc $? t=$(el)s" >> $S
  grep -E "^W|wide|library|4-warp" $f | grep -v "^wide build" | head -24 >> $S
done
save
for i in 1 2; do
  for r in 0 1; do
    PONDER_DECODE_RING=$r timeout 60 .device/bench_looped --suite cb --widths 24,32 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_ring${r}_$i.json > /tmp/j/cb2k_ring${r}_$i.log 2>&1
    echo "== cb 2k W 24/32 PONDER_DECODE_RING=$r run $i rc $? t=$(el)s" >> $S
    grep -E "^ +(24|32) |rror|panic" /tmp/j/cb2k_ring${r}_$i.log | head -3 >> $S
  done
done
save
cat $S
