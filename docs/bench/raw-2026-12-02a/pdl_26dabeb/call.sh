# Session 17, call 2: programmatic dependent launch in captured graphs (26dabeb). Validate (graph test first, then the full
# gpu_kernels suite), then A/B/A/B in one binary: PONDER_PDL=0 (captured edges) vs default (programmatic edges).
set -u
C=26dabeb
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > $S
timeout 120 .device/gpu_kernels --test-threads 1 --nocapture cuda_graphs_match_eager > /tmp/gk1.log 2>&1; OK1=$?
echo "gpu_kernels cuda_graphs_match_eager rc $OK1 t=$(( $(date +%s) - start ))s" >> $S
grep -E "cuda graphs|panicked|test result|ponder:" /tmp/gk1.log | head -20 >> $S
if [ $OK1 -ne 0 ]; then tail -c 8000 /tmp/gk1.log > $OUT/r/gk_fail.log; cat $S; exit 1; fi
timeout 150 .device/gpu_kernels --test-threads 1 > /tmp/gk.log 2>&1; OK2=$?
echo "gpu_kernels full rc $OK2 t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|panicked|FAILED|failed" /tmp/gk.log | head -20 >> $S
python3 -c "import lzma,shutil; shutil.copyfileobj(open('/tmp/gk.log','rb'), lzma.open('$OUT/r/gpu_kernels.log.xz','wb'))"
if [ $OK2 -ne 0 ]; then tail -c 8000 /tmp/gk.log > $OUT/r/gk_fail.log; cat $S; exit 1; fi
for i in 1 2; do
  for v in off on; do
    E=""; [ $v = off ] && E="PONDER_PDL=0"
    env $E timeout 120 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb pdl $v $i rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |programmatic|peak|bandwidth" /tmp/j/cb_${v}_$i.log >> $S
  done
done
for v in off on; do
  E=""; [ $v = off ] && E="PONDER_PDL=0"
  env $E timeout 100 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --requests-per-width 2 --time-device --commit $C --json /tmp/j/cdb_${v}.json > /tmp/j/cdb_${v}.log 2>&1
  echo "== cdb pdl $v rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +64 |roofline|bound" /tmp/j/cdb_${v}.log | head -12 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_pdl.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
