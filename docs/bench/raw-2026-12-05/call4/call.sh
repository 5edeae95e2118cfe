# Session 25, call 4: depth batching W 64 with the decode ring (80395e4 binaries; Auto takes the
# ring at 64 rows) vs PONDER_DECODE_RING=0, shared and last-exited layouts, alternated three times.
set -u
C=80395e4
mkdir -p $OUT/r /tmp/j
cp .device/call4.sh $OUT/r/call.sh
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
for rep in 1 2 3; do
  for lay in shared last-exited; do
    for r in on off; do
      [ $(el) -lt 230 ] || break 3
      case $r in off) ring=0;; *) ring=;; esac
      n=cdb_${lay}_${r}$rep
      PONDER_DECODE_RING=$ring timeout 40 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout $lay --time-device --commit $C --json /tmp/j/$n.json > /tmp/j/$n.log 2>&1
      echo "== $n rc $? t=$(el)s" >> $S
      grep -E "^ +64 |roofline|rror|panic" /tmp/j/$n.log | head -6 >> $S
    done
  done
  save
done
save
cat $S
