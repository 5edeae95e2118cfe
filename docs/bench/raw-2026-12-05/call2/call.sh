# Session 25, call 2: the decode ring as equal runs of the launch's stages over a fixed grid (c21fd3e).
# attn_ring_probe (library ring vs SIMT per launch, varied and even contexts); device tests decode_;
# CB prompt 128 (W 16/64/256) ring on/off alternated twice; prompt 2048; depth batching W 64 on/off.
set -u
C=c21fd3e
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
timeout 90 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/probe_build.log 2>&1
echo "== probe build rc $? t=$(el)s" >> $S
timeout 60 /tmp/attn var 16,64,256 > /tmp/j/probe_var.log 2>&1; rc=$?; echo "== probe var rc $rc t=$(el)s" >> $S
if [ $rc -eq 124 ]; then tail -40 /tmp/j/probe_var.log >> $S; save; cat $S; exit 1; fi
timeout 40 /tmp/attn 260 > /tmp/j/probe_260.log 2>&1; echo "== probe 260 rc $? t=$(el)s" >> $S
grep -v "ring, " /tmp/j/probe_var.log /tmp/j/probe_260.log >> $S
source .device/unpack.sh
timeout 110 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|ring" /tmp/j/tests.log | head -30 >> $S
save
for r in on1 off1 on2 off2; do
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 75 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in on off; do
  [ $(el) -lt 380 ] || break
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 60 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_$r.json > /tmp/j/cdb_$r.log 2>&1
  echo "== cdb $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$r.log | head -12 >> $S
  save
done
for r in on off; do
  [ $(el) -lt 470 ] || break
  case $r in off*) ring=0;; *) ring=1;; esac
  PONDER_DECODE_RING=$ring timeout 60 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
cat $S
