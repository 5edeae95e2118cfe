# Session 18, call 6: 2k-token prompts (W 16 / 64, 256 new) with main's attention (29da027) and the
# 7-block attention (1561924), alternated twice.
set -u
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3],'wb'))" .device/old/bench_looped.xz; chmod +x .device/old/bench_looped
S=$OUT/r/summary.txt
start=$(date +%s)
for i in 1 2; do
  for v in old occ7; do
    B=.device/bench_looped; C=1561924
    [ $v = old ] && B=.device/old/bench_looped && C=29da027
    timeout 70 $B --suite cb --widths 16,64 --prompt-len 2048 --new-tokens 256 --commit $C --json /tmp/j/cb2k_${v}_$i.json > /tmp/j/cb2k_${v}_$i.log 2>&1
    echo "== cb 2k $v ($C) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64) |bandwidth" /tmp/j/cb2k_${v}_$i.log >> $S
  done
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_2k_occupancy.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
