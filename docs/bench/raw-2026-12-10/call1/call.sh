# Session 30, call 1: full gpu_kernels at the packed commit (d868fca's kernels; its changes never ran on the device);
# tools/attn_ring_probe.cu `wide` (one-query builds of 8 / 16 warps a block, no split or in-kernel cut) at ctx 260, varied, 1024, 2176;
# CB W 24 / 32 with PONDER_DECODE_RING 0 / 1 alternated twice (RING_ROPE_MIN_ROWS against the SIMT fold).
set -u
C=f62a3ae
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
(nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/nvcc.log 2>&1; echo "nvcc rc $?" >> /tmp/j/nvcc.log) &
NV=$!
timeout 200 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|panicked|FAILED|failed" /tmp/j/tests.log | head -20 >> $S
wait $NV
tail -2 /tmp/j/nvcc.log >> $S
save
for a in "260 16,32,64" "var 16,64" "1024 16,64" "2176 16,64"; do
  n=$(echo $a | tr ' ,' '__')
  timeout 90 /tmp/attn $a wide > /tmp/j/wide_$n.log 2>&1
  echo "== probe wide $a rc $? t=$(el)s" >> $S
  grep -E "wide|library, its plan|rel err|SMs|blocks an SM" /tmp/j/wide_$n.log | grep -v "ring" >> $S
done
save
for w in 24 32; do
  for r in r0a r1a r0b r1b; do
    [ $(el) -lt 520 ] || break
    timeout 40 env PONDER_DECODE_RING=${r:1:1} .device/bench_looped --suite cb --widths $w --new-tokens 256 --commit $C --json /tmp/j/cb${w}_$r.json > /tmp/j/cb${w}_$r.log 2>&1
    echo "== cb W $w ring=${r:1:1} ($r) rc $? t=$(el)s" >> $S
    grep -E "^ +$w |rror|panic" /tmp/j/cb${w}_$r.log | head -3 >> $S
  done
done
save
cat $S
