# Session 23, call 1 (2442fb3 = main 8246773 + the greedy readout 8963f1d + vectorised SiLU·mul
# 0e46028): device tests (split-K, decode, graphs, greedy readout, SiLU·mul); the graph memory-node
# probe; CB prompt 128 (W 16 / 64 / 256) main (8246773) / new alternated twice; depth batching W 64
# (shared) main / new. Saved after every run.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 150 .device/gpu_kernels --test-threads 1 split_k decode_ cuda_graphs greedy fused_silu_mul > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests.log | head -30 >> $S
grep -cE "^test .* ok$" /tmp/j/tests.log >> $S
save
timeout 60 python3 tools/graph_nodes_probe.py --json /tmp/j/graph_nodes.json > /tmp/j/graph_nodes.log 2>&1
echo "== graph nodes probe rc $? t=$(( $(date +%s) - start ))s" >> $S
tail -6 /tmp/j/graph_nodes.log >> $S
save
for r in old1 new1 old2 new2; do
  b=.device/bench_looped; c=$C; case $r in old*) b=.device/bench_looped_old; c=8246773;; esac
  timeout 80 $b --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in old new; do
  b=.device/bench_looped; c=$C; case $r in old*) b=.device/bench_looped_old; c=8246773;; esac
  timeout 60 $b --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $c --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
  save
done
cat $S
