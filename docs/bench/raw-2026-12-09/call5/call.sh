# Session 29, call 5: qkv_rope_write folded into the one-query SIMT kernel for MHA decode launches the ring declines
# (e023c3e, "new") against 94a3ef3 ("old"). Fold tests (ring and SIMT), decode tests, graphs, Ouro end to end; CB W 16 and
# prompt 2048 W 16 new/old alternated twice, and new with PONDER_FOLD_SIMT=0 once each (the switch reproduces old).
set -u
C=e023c3e
mkdir -p $OUT/r /tmp/j
cp .device/call5.sh $OUT/r/call.sh
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
timeout 150 .device/gpu_kernels --test-threads 1 --nocapture fused_qkv_rope_attention decode_ cuda_graphs_match_eager ouro_decode_on_the_folded > /tmp/j/tests.log 2>&1
rc=$?
echo "== tests rc $rc t=$(el)s" >> $S
grep -E "^test |test result|panicked|qkv_rope_attention .*folded|differs" /tmp/j/tests.log | head -60 >> $S
save
[ $rc -eq 0 ] || { cat $S; exit 0; }
for r in new1 old1 new2 old2 off; do
  case $r in off) E="env PONDER_FOLD_SIMT=0";; *) E=env;; esac
  timeout 30 $E $(bin $r) --suite cb --widths 16 --new-tokens 256 --commit $C --json /tmp/j/cb_$r.json > /tmp/j/cb_$r.log 2>&1
  echo "== cb W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb_$r.log | head -4 >> $S
done
save
for r in new1 old1 new2 old2 off; do
  [ $(el) -lt 330 ] || break
  case $r in off) E="env PONDER_FOLD_SIMT=0";; *) E=env;; esac
  timeout 40 $E $(bin $r) --suite cb --widths 16 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_$r.json > /tmp/j/cb2k_$r.log 2>&1
  echo "== cb 2k W 16 $r rc $? t=$(el)s" >> $S
  grep -E "^ +16 |rror|panic" /tmp/j/cb2k_$r.log | head -4 >> $S
done
save
cat $S
