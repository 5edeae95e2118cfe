# Session 30, call 6: the final code (d76afbb): full gpu_kernels; CB W 16 / 64 / 256 and prompt 2048 W 16 (standing); CB W 24 (the
# 32-row bucket, now on the SIMT fold by default).
set -u
C=d76afbb
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
grep -E "test result|panicked|FAILED|failed" /tmp/j/tests.log | head -20 >> $S
save
timeout 150 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb.json > /tmp/j/cb.log 2>&1
echo "== cb W 16/64/256 rc $? t=$(el)s" >> $S
grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb.log | head -6 >> $S
save
timeout 40 .device/bench_looped --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k.json > /tmp/j/cb2k.log 2>&1
echo "== cb 2k W 16 rc $? t=$(el)s" >> $S
grep -E "^ +16 |rror|panic" /tmp/j/cb2k.log | head -3 >> $S
timeout 40 .device/bench_looped --suite cb --widths 24 --new-tokens 256 --commit $C --json /tmp/j/cb24.json > /tmp/j/cb24.log 2>&1
echo "== cb W 24 rc $? t=$(el)s" >> $S
grep -E "^ +24 |rror|panic" /tmp/j/cb24.log | head -3 >> $S
save
cat $S
