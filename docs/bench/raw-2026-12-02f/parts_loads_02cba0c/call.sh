# Session 22, call 4 (02cba0c): norms of partials with every slice's loads issued first. Split-K
# device test; CB prompt 128 (W 16 / 64 / 256) old (11777af) / new alternated twice; new alone:
# prompt 2048 (W 16 / 64), depth batching W 64 (mean depth 2.5, refill) on shared and
# last-exited K/V. Saved after every run.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call4.sh $OUT/r/call.sh
source .device/unpack.sh
S=$OUT/r/summary.txt
start=$(date +%s)
save() {
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 60 .device/gpu_kernels --test-threads 1 split_k > /tmp/j/tests.log 2>&1
echo "== split-K test rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^test |test result|FAILED|panicked|split-K" /tmp/j/tests.log | head -30 >> $S
save
for r in old1 new1 old2 new2; do
  b=.device/bench_looped; c=$C; case $r in old*) b=.device/bench_looped_old; c=11777af;; esac
  timeout 60 $b --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |bandwidth|rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
timeout 80 .device/bench_looped --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k.json > /tmp/j/cb2k.log 2>&1
echo "== cb 2k rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k.log | head -6 >> $S
save
for lay in shared last-exited; do
  timeout 60 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout $lay --time-device --commit $C --json /tmp/j/cdb_$lay.json > /tmp/j/cdb_$lay.log 2>&1
  echo "== cdb $lay rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_$lay.log | head -12 >> $S
  save
done
cat $S
