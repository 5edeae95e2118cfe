# Session 26, call 1: split launches merged in the kernel (last block to arrive), 852e50f, against main before it (3107341, bench_looped_old).
# attn_ring_probe (merged vs combine launch, per launch); device tests decode_ + graph tests, default and PONDER_SPLIT_MERGE=0;
# CB prompt 128 new/old alternated twice + new with the combine; depth batching W 64 new/old; prompt 2048 new/old.
set -u
C=852e50f
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call1.sh $OUT/r/call.sh
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
timeout 90 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/probe_build.log 2>&1
echo "== probe build rc $? t=$(el)s" >> $S
timeout 60 /tmp/attn 260 16,32,64,256 > /tmp/j/probe_260.log 2>&1; echo "== probe 260 rc $? t=$(el)s" >> $S
timeout 60 /tmp/attn var 16,64,256 > /tmp/j/probe_var.log 2>&1; echo "== probe var rc $? t=$(el)s" >> $S
grep -v "ring, " /tmp/j/probe_260.log /tmp/j/probe_var.log >> $S
source .device/unpack.sh
timeout 150 .device/gpu_kernels --test-threads 1 decode_ cuda_graphs_match_eager huginn_stage_graphs > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|^test " /tmp/j/tests.log | head -30 >> $S
PONDER_SPLIT_MERGE=0 timeout 90 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests_combine.log 2>&1
echo "== tests (combine launch) rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests_combine.log | head -10 >> $S
save
for r in new1 old1 new2 old2 comb; do
  [ $(el) -lt 420 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  case $r in comb) sm=0;; *) sm=;; esac
  PONDER_SPLIT_MERGE=$sm timeout 90 $bin --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in new old; do
  [ $(el) -lt 470 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 40 $bin --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $c --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
  save
done
for r in new old; do
  [ $(el) -lt 500 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 55 $bin --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $c --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
cat $S
