# Session 17, call 5: one more LLaDA2.0-mini table at HEAD (diffusion code as 0f89502) and five paired B 32 runs of
# the delayed cache and FOCUS (one request per slot), to settle B 32 before issue 19 is closed.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
timeout 300 .device/bench_diffusion --model llada2-mini --batches 32,64,128,256 --modes baseline,baseline-delayed,focus --focus-knee 2800 --requests-per-batch 2 --repeats 3 --commit $C --json $OUT/r/llada2.json > /tmp/j/table.log 2>&1
echo "== table ($C) rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(32|64|128|256) |peak" /tmp/j/table.log >> $S
cp /tmp/j/table.log $OUT/r/llada2.log
for i in 1 2 3 4 5; do
  timeout 60 .device/bench_diffusion --model llada2-mini --batches 32 --modes baseline-delayed,focus --focus-knee 2800 --requests-per-batch 1 --commit $C --json /tmp/j/b32_$i.json > /tmp/j/b32_$i.log 2>&1
  echo "== b32 $i rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +32 " /tmp/j/b32_$i.log >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/b32_*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/b32_pairs.json','w'),indent=1)
PY
cat $S
