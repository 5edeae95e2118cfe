# Session 27, call 12: CB W 16 with 2048-token prompts, the SIMT path (default: the ring from 64 rows) against the ring forced
# (PONDER_DECODE_RING=1), one binary (73ac059), alternated twice — the probe had the ring 20 % faster a launch at W 16, ctx 1024.
set -u
C=73ac059
mkdir -p $OUT/r /tmp/j
cp .device/call12.sh $OUT/r/call.sh
S=$OUT/r/summary.txt
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
source .device/unpack.sh
for r in simt1 ring1 simt2 ring2; do
  [ $(el) -lt 150 ] || break
  case $r in ring*) ring=1;; *) ring=;; esac
  PONDER_DECODE_RING=$ring timeout 60 .device/bench_looped --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k16_$r.json > /tmp/j/cb2k16_$r.log 2>&1
  echo "== cb 2k W16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb2k16_$r.log | head -3 >> $S
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/runs.json','w'),indent=1)
PY
cp /tmp/j/*.log $OUT/r/ 2>/dev/null
cat $S
