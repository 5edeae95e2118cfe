# Session 22, call 3 (11777af): the split-K plan from output tiles (Huginn runs whole again).
# Device tests; Huginn CB A/B (PONDER_SPLIT_K=0 = never split, default); Ouro CB prompt 128
# default once; tools/l2_probe.py (hot vs cold projections, L2 warming on a side stream); ncu
# per-kernel breakdown of one replayed decode step at W 16 and 64 (prompt 256 + 4 steps).
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call3.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log *.csv 2>/dev/null)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 120 .device/gpu_kernels --test-threads 1 split_k cuda_graphs huginn_stage > /tmp/j/tests.log 2>&1
echo "== device tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^test |test result|FAILED|panicked|split-K" /tmp/j/tests.log | head -30 >> $S
save
for v in A B A; do
  e="PONDER_X=0"; [ $v = A ] && e="PONDER_SPLIT_K=0"
  env $e timeout 60 .device/bench_looped --model huginn --suite cb --widths 16,64 --new-tokens 128 --repeats 1 --commit $C --json /tmp/j/huginn_$v.json > /tmp/j/huginn_$v.log 2>&1
  echo "== huginn cb $v ($e): rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/huginn_$v.log | head -6 >> $S
  save
done
timeout 60 .device/bench_looped --suite cb --widths 16,64 --new-tokens 256 --commit $C --json /tmp/j/cb.json > /tmp/j/cb.log 2>&1
echo "== cb (default) rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb.log | head -8 >> $S
save
timeout 150 python3 .device/l2_probe.py --json $OUT/r/l2_probe.json > /tmp/j/l2_probe.log 2>&1
echo "== l2 probe rc $? t=$(( $(date +%s) - start ))s" >> $S
tail -20 /tmp/j/l2_probe.log >> $S
save
for w in 16 64; do
  timeout 150 ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv .device/bench_looped --suite cb --widths $w --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $C > /tmp/j/step_w$w.csv 2> /tmp/j/step_w$w.err
  echo "== ncu step W $w rc $? t=$(( $(date +%s) - start ))s" >> $S
  save
done
cat $S
