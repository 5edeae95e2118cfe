# Session 23, call 5: which half of call 4's attention change costs and which pays. e2 (2fe6721):
# block-table staging + two alternating K/V register sets; e4 (5dbb0a7): only the last-block merge
# of split tiles (no combine launch), on main. CB prompt 128 (W 16 / 64 / 256) main (2442fb3) / e2 /
# e4 as old, e4, e2, old, e4 (the device budget left no second e2 run); prompt 2048 (W 16 / 64)
# main / e4. Saved after every run, in order of importance.
set -u
C=$(cat .device/commit)
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
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
pick() { case $1 in old*) b=.device/bench_looped_old; c=2442fb3;; e2*) b=.device/bench_looped_e2; c=2fe6721;; *) b=.device/bench_looped; c=$C;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
for r in old1 e41 e21 old2 e42; do
  pick $r
  timeout 80 $b --suite cb --widths 16,64,256 --new-tokens 256 --commit $c --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
  save
done
for r in old e4; do
  pick $r
  timeout 80 $b --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $c --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k $r ($c) rc $? t=$(( $(date +%s) - start ))s" >> $S
  grep -E "^ +(16|64) |rror|panic" /tmp/j/cb2k_$r.log | head -6 >> $S
  save
done
cat $S
