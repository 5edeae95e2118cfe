# Session 26, call 2: the ring merges split rows in the kernel (SIMT keeps its combine), fccc9b3, against main before (3107341, bench_looped_old).
# tests decode_ + graph tests (default), decode_ring with PONDER_RING_MERGE=0; CB prompt 128 new/old x2; depth batching shared + last-exited new/old;
# prompt 2048 new/old; Huginn CB W 16/64 (no ring there: 55 heads, head dim 96).
set -u
C=fccc9b3
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call2.sh $OUT/r/call.sh
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
source .device/gpu-env.sh 2>/dev/null || true
source .device/unpack.sh
timeout 150 .device/gpu_kernels --test-threads 1 decode_ cuda_graphs_match_eager huginn_stage_graphs > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|^test " /tmp/j/tests.log | head -30 >> $S
PONDER_RING_MERGE=0 timeout 60 .device/gpu_kernels --test-threads 1 decode_ring decode_many decode_long > /tmp/j/tests_combine.log 2>&1
echo "== tests (ring combine launch) rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests_combine.log | head -10 >> $S
save
for r in new1 old1 new2 old2; do
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 90 $bin --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for lay in shared last-exited; do
for r in new old; do
  [ $(el) -lt 400 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 40 $bin --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout $lay --time-device --commit $c --json /tmp/j/cdb_${lay}_$r.json > /tmp/j/cdb_${lay}_$r.log 2>&1
  echo "== cdb $lay $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_${lay}_$r.log | head -12 >> $S
  save
done
done
[ $(el) -lt 440 ] && { timeout 60 .device/bench_looped --model huginn --suite cb --widths 16,64 --new-tokens 128 --repeats 1 --commit $C --json /tmp/j/huginn.json > /tmp/j/huginn.log 2>&1
  echo "== huginn rc $? t=$(el)s" >> $S; grep -E "^ +(16|64) |rror|panic" /tmp/j/huginn.log | head -6 >> $S; save; }
for r in new old; do
  [ $(el) -lt 490 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 55 $bin --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $c --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
cat $S
