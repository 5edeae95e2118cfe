# Session 26, call 7: depth batching W 64 (shared K/V, then last-exited) alternated, c3761f3 (bench_looped) vs main 3107341 (bench_looped_old) — call 6's single pair disagreed with the CB runs.
set -u
C=c3761f3
O=3107341
mkdir -p $OUT/r /tmp/j
cp .device/call7.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
source .device/unpack.sh
for spec in "shared old1" "shared new1" "shared old2" "shared new2" "last-exited new" "last-exited old"; do
  set -- $spec; lay=$1; r=$2
  [ $(el) -lt 110 ] || break
  case $r in old*) bin=.device/bench_looped_old; c=$O;; *) bin=.device/bench_looped; c=$C;; esac
  timeout 60 $bin --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout $lay --time-device --commit $c --json /tmp/j/cdb_${lay}_$r.json > /tmp/j/cdb_${lay}_$r.log 2>&1
  echo "== cdb $lay $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|rror|panic" /tmp/j/cdb_${lay}_$r.log | head -6 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
cat $S
