# Session 29, call 3: split merges that batch their loads (a5561ab, "new") against 31be55f ("old", the norms' change on).
# The decode tests (every split path ends in the merge) + graphs; CB W 16 (the SIMT kernel and its combine) and prompt 2048 W 16, alternated twice;
# then ncu warm per-kernel durations of one step at W 16, prompt 256 (context of the benchmark's mean), new binary.
set -u
C=a5561ab
mkdir -p $OUT/r /tmp/j
cp .device/call3.sh $OUT/r/call.sh
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
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log *.err 2>/dev/null)
}
bin() { case $1 in old*) echo .device/bench_looped_old;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 120 .device/gpu_kernels --test-threads 1 --nocapture decode_ cuda_graphs_match_eager > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked" /tmp/j/tests.log | head -50 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for r in new1 old1 new2 old2; do
  timeout 30 $(bin $r) --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb_$r.log | head -4 >> $S
done
save
for r in new1 old1 new2 old2; do
  timeout 40 $(bin $r) --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb2k_$r.log | head -4 >> $S
done
save
timeout 60 ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv .device/bench_looped --suite cb --widths 16 --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step --commit $C > /tmp/j/step_w16.csv 2> /tmp/j/step_w16.err
echo "== ncu warm step W 16 prompt 256 rc $? t=$(el)s" >> $S
xz -9 -c /tmp/j/step_w16.csv > $OUT/r/step_w16_p256.csv.xz
save
cat $S
