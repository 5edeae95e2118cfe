# Session 26, call 4: the cost of a captured graph's memory nodes (tools/graph_nodes_probe.cu): a chain of 1000 kernels, preallocated vs alloc/free nodes around each (as candle captures).
set -u
mkdir -p $OUT/r
cp .device/call4.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
source .device/gpu-env.sh 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $S
timeout 90 nvcc -O3 -std=c++17 -arch=sm_90a tools/graph_nodes_probe.cu -o /tmp/gn >> $S 2>&1; echo "== build rc $?" >> $S
timeout 60 /tmp/gn 1000 >> $S 2>&1; echo "== probe 1000 rc $?" >> $S
timeout 60 /tmp/gn 300 >> $S 2>&1; echo "== probe 300 rc $?" >> $S
cat $S
