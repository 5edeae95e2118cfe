# Session 29, call 2: row norms that issue every load before their first reduction (31be55f, "new") against ebd9a0d ("old").
set -u
C=31be55f
mkdir -p $OUT/r /tmp/j
cp .device/call2.sh $OUT/r/call.sh
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
bin() { case $1 in old*) echo .device/bench_looped_old;; *) echo .device/bench_looped;; esac; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 120 .device/gpu_kernels --test-threads 1 --nocapture fused_add_rms_norm fused_rms_norm split_k_partials cuda_graphs_match_eager > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked" /tmp/j/tests.log | head -50 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for r in new1 old1 new2 old2; do
  timeout 60 $(bin $r) --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb $r rc $? t=$(el)s" >> $S
  grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_$r.log | head -8 >> $S
done
save
for r in new1 old1 new2 old2; do
  [ $(el) -lt 250 ] || break
  timeout 30 $(bin $r) --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --time-device --commit $C --json /tmp/j/cdb_shared_$r.json > /tmp/j/cdb_shared_$r.log 2>&1
  echo "== cdb shared $r rc $? t=$(el)s" >> $S
  grep -E "^ +64 |roofline|device time|rror|panic" /tmp/j/cdb_shared_$r.log | head -12 >> $S
done
for r in new1 old1 new2 old2; do
  [ $(el) -lt 330 ] || break
  timeout 40 $(bin $r) --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb2k_$r.log | head -4 >> $S
done
save
cat $S
