# Written in session 31 for the deep 8-warp build (ec19f1e and after; old = f9c4014), not run there (no device lent):
# the full device suite (the deep build and the ring's move to attention_ring.rs have not run); CB W 6 / 8 new vs old alternated twice; CB W 16 at prompt 128 and 2048, default vs
# PONDER_SIMT_DEEP=2 (the deep build at two blocks an SM), alternated; depth batching W 64 with --overlap off / on, shared and
# last-exited K/V (the standing's depth-batching rows were measured with overlap off). Run as `C=<packed commit> bash .device/call2.sh`.
set -u
C=${C:?set C to the commit tools/device/pack.sh printed}
mkdir -p $OUT/r /tmp/j
cp .device/call2.sh $OUT/r/call.sh
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
timeout 230 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|panicked|FAILED|failed" /tmp/j/tests.log | head -20 >> $S
save
timeout 150 .device/bench_looped_old --suite cb --widths 8 --new-tokens 8 > /tmp/j/warm_old.log 2>&1
echo "== warm old rc $? t=$(el)s" >> $S
for i in 1 2; do
  for b in old new; do
    bin=.device/bench_looped; [ $b = old ] && bin=.device/bench_looped_old
    c=$C; [ $b = old ] && c=f9c4014
    timeout 60 $bin --suite cb --widths 6,8 --new-tokens 256 --commit $c --json /tmp/j/cb68_${b}_$i.json > /tmp/j/cb68_${b}_$i.log 2>&1
    echo "== cb W 6/8 $b run $i rc $? t=$(el)s" >> $S
    grep -E "^ +(6|8) |rror|panic" /tmp/j/cb68_${b}_$i.log | head -3 >> $S
  done
done
save
for i in 1 2; do
  for d in 1 2; do
    PONDER_SIMT_DEEP=$d timeout 40 .device/bench_looped --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/cb16_deep${d}_$i.json > /tmp/j/cb16_deep${d}_$i.log 2>&1
    echo "== cb W 16 PONDER_SIMT_DEEP=$d run $i rc $? t=$(el)s" >> $S
    grep -E "^ +16 |rror|panic" /tmp/j/cb16_deep${d}_$i.log | head -3 >> $S
  done
done
save
for i in 1 2; do
  for d in 1 2; do
    PONDER_SIMT_DEEP=$d timeout 50 .device/bench_looped --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_deep${d}_$i.json > /tmp/j/cb2k_deep${d}_$i.log 2>&1
    echo "== cb 2k W 16 PONDER_SIMT_DEEP=$d run $i rc $? t=$(el)s" >> $S
    grep -E "^ +16 |rror|panic" /tmp/j/cb2k_deep${d}_$i.log | head -3 >> $S
  done
done
save
for i in 1 2; do
  for o in off on; do
    timeout 40 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --overlap $o --time-device --commit $C --json /tmp/j/cdb_shared_${o}_$i.json > /tmp/j/cdb_shared_${o}_$i.log 2>&1
    echo "== cdb W 64 shared overlap $o run $i rc $? t=$(el)s" >> $S
    grep -E "cdb-refill|rror|panic" /tmp/j/cdb_shared_${o}_$i.log | head -3 >> $S
  done
done
for o in off on; do
  timeout 40 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout last-exited --overlap $o --time-device --commit $C --json /tmp/j/cdb_last_${o}.json > /tmp/j/cdb_last_${o}.log 2>&1
  echo "== cdb W 64 last-exited overlap $o rc $? t=$(el)s" >> $S
  grep -E "cdb-refill|rror|panic" /tmp/j/cdb_last_${o}.log | head -3 >> $S
done
save
cat $S
