# Session 30, call 3: attn_ring_probe.cu `wide` round 2 (the library's 8-warp build against more key sets a step / more warps),
# then the standing of 2d78dc2 (CB W 16 / 64 / 256) and a warm-L2 ncu step profile at W 16.
set -u
C=2d78dc2
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
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> $S
timeout 120 nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn > /tmp/j/nvcc.log 2>&1
echo "== nvcc rc $? t=$(el)s" >> $S
for a in "260 16,24" "var 16" "1024 16" "2176 16"; do
  n=$(echo $a | tr ' ,' '__')
  timeout 60 /tmp/attn $a wide > /tmp/j/wide_$n.log 2>&1
  echo "== probe wide $a rc $? t=$(el)s" >> $S
  grep -E "wide|4-warp|rel err|SMs|blocks an SM" /tmp/j/wide_$n.log | grep -v "ring" >> $S
done
save
timeout 60 .device/bench_looped --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_new.json > /tmp/j/cb_new.log 2>&1
echo "== cb W 16/64/256 rc $? t=$(el)s" >> $S
grep -E "^ +(16|64|256) |rror|panic" /tmp/j/cb_new.log | head -6 >> $S
save
timeout 90 ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv .device/bench_looped --suite cb --widths 16 --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step > /tmp/j/ncu_w16.csv 2> /tmp/j/ncu_w16.log
echo "== ncu W 16 rc $? t=$(el)s" >> $S
python3 tools/kernel_breakdown.py /tmp/j/ncu_w16.csv >> $S 2>&1
python3 -c "import lzma,shutil; shutil.copyfileobj(open('/tmp/j/ncu_w16.csv','rb'), lzma.open('/tmp/j/ncu_w16.csv.xz','wb'))" && cp /tmp/j/ncu_w16.csv.xz $OUT/r/
save
cat $S
