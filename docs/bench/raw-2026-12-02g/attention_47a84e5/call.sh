# Session 23, call 4: attention for decode. e2 (2fe6721): the one-query kernel stages its
# block-table entries in shared memory and alternates two register sets of K/V; e3 (47a84e5): also
# merges split tiles in their last block (no combine launch). Device tests (decode_); CB prompt 128
# (W 16 / 64 / 256) main (2442fb3) / e3 alternated twice (e2 alone did not fit the carry); prompt 2048 (W 16 / 64) main / e3.
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
timeout 100 .device/gpu_kernels --test-threads 1 decode_ > /tmp/j/tests.log 2>&1
echo "== tests rc $? t=$(( $(date +%s) - start ))s" >> $S
grep -E "test result|FAILED|panicked" /tmp/j/tests.log | head -20 >> $S
save
for r in old1 e31 old2 e32; do
  case $r in old*) b=.device/bench_looped_old; c=2442fb3;; e2*) b=.device/bench_looped_e2; c=2fe6721;; *) b=.device/bench_looped; c=$C;; esac
  timeout 80 $b --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in old e3; do
  case $r in old*) b=.device/bench_looped_old; c=2442fb3;; *) b=.device/bench_looped; c=$C;; esac
  timeout 80 $b --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $c --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
cat $S
