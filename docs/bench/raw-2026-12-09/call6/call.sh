# Session 29, call 6: the full gpu_kernels at e023c3e (the SIMT fold; main's code since is docs only), then CB prompt 128
# W 16 / 64 / 256 twice (the standing of main).
set -u
C=e023c3e
mkdir -p $OUT/r /tmp/j
cp .device/call6.sh $OUT/r/call.sh
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
timeout 200 .device/gpu_kernels --test-threads 1 > /tmp/j/tests.log 2>&1
echo "== full gpu_kernels rc $? t=$(el)s" >> $S
grep -E "test result|FAILED|panicked|failed" /tmp/j/tests.log | head -20 >> $S
save
for r in 1 2; do
  timeout 60 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_new$r.json > /tmp/j/cb_new$r.log 2>&1
  echo "== cb run $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_new$r.log | head -8 >> $S
  save
done
cat $S
