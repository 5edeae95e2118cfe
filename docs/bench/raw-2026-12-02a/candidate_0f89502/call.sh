# Session 17, call 1: candidate 0f89502 = main c025356 + fast SiLU + idle-consumer skip + packed PagedBatch upload.
# Full gpu_kernels suite, A/B/A/B against c025356 (.device/old), per-kernel ncu times old/new, then the table with the winner.
set -u
C=0f89502; OLDC=c025356
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.device/old/bench_diffusion.xz'), open('.device/old/bench_diffusion','wb'))"; chmod +x .device/old/bench_diffusion
S=$OUT/r/summary.txt
NCU=/usr/local/cuda/bin/ncu
start=$(date +%s)
timeout 150 .device/gpu_kernels --test-threads 1 > /tmp/gk.log 2>&1; OK1=$?
echo "gpu_kernels full rc $OK1 t=$(( $(date +%s) - start ))s" | tee $S
grep -E "test result|panicked|FAILED|failed" /tmp/gk.log | head -20 >> $S
python3 -c "import lzma,shutil; shutil.copyfileobj(open('/tmp/gk.log','rb'), lzma.open('$OUT/r/gpu_kernels.log.xz','wb'))"
if [ $OK1 -ne 0 ]; then tail -c 6000 /tmp/gk.log > $OUT/r/gk_fail.log; cat $S; exit 1; fi
AB="--model llada2-mini --batches 32,256 --modes baseline,baseline-delayed,focus --focus-knee 2800 --requests-per-batch 1"
for i in 1 2; do
  for v in old new; do
    B=.device/bench_diffusion; CC=$C; [ $v = old ] && B=.device/old/bench_diffusion && CC=$OLDC
    timeout 100 $B $AB --commit $CC --json /tmp/j/ab_${v}_$i.json > /tmp/j/ab_${v}_$i.log 2>&1
    echo "== ab $v $i rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(32|64|128|256) |peak" /tmp/j/ab_${v}_$i.log >> $S
  done
done
WIN=$(python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/ab_*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_candidate.json','w'),indent=1)
def tp(v,b,m):
    xs=[r['window_tokens_per_s'] for k,d in out.items() if k.startswith('ab_'+v) for r in d['results'] if r['batch']==b and r['mode']==m]
    return sum(xs)/max(len(xs),1)
import sys
for b in (32,256):
    for m in ('baseline','baseline-delayed','focus'):
        print(f"{b} {m}: new/old {tp('new',b,m)/max(tp('old',b,m),1e-9):.3f}", file=sys.stderr)
print('new' if tp('new',256,'baseline')>=tp('old',256,'baseline') else 'old')
PY
2>>$S)
echo "== winner at B256 baseline: $WIN" >> $S
for v in old new; do
  B=.device/bench_diffusion; [ $v = old ] && B=.device/old/bench_diffusion
  timeout 80 $NCU --profile-from-start off --clock-control none --kernel-name "regex:moe_wgmma_swiglu_bf16|moe_wgmma_bf16" --launch-count 4 \
    --metrics gpu__time_duration.sum --csv $B --model llada2-mini --batches 256 --modes baseline --requests-per-batch 1 --new-tokens 64 --profile-step > /tmp/ncu_$v.csv 2>/dev/null
  echo "== ncu $v rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "moe_wgmma" /tmp/ncu_$v.csv | awk -F'","' '{print $5, $NF}' | cut -c1-60,200- | tail -4 >> $S
  cp /tmp/ncu_$v.csv $OUT/r/
done
B=.device/bench_diffusion; CC=$C; [ "$WIN" = old ] && B=.device/old/bench_diffusion && CC=$OLDC
timeout 300 $B --model llada2-mini --batches 32,64,128,256 --modes baseline,baseline-delayed,focus --focus-knee 2800 --requests-per-batch 2 --repeats 3 --commit $CC --json $OUT/r/llada2.json > /tmp/j/table.log 2>&1
echo "== table ($CC) rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(32|64|128|256) |peak" /tmp/j/table.log >> $S
cp /tmp/j/table.log $OUT/r/llada2.log
cat $S
