# Session 18, call 4: the one-query attention kernel at 7 (occ7, 72 registers) and 8 (occ8, 64 registers)
# blocks an SM against main (6 blocks, 80 registers): CB (tests of the winner in the next call:
# three binaries fill the carry)
# W 16 / 64 / 256 (prompt 128 + 256 new) with the three binaries alternated twice (ABCABC).
set -u
C8=$(cat .device/commit); C7=$(cat .device/occ7/commit)
mkdir -p $OUT/r /tmp/j
source .device/unpack.sh
for f in .device/old/bench_looped.xz .device/occ7/bench_looped.xz; do
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3],'wb'))" "$f"; chmod +x "${f%.xz}"
done
S=$OUT/r/summary.txt
start=$(date +%s)
for i in 1 2; do
  for v in old occ7 occ8; do
    B=.device/bench_looped; C=$C8
    [ $v = old ] && B=.device/old/bench_looped && C=29da027
    [ $v = occ7 ] && B=.device/occ7/bench_looped && C=$C7
    timeout 100 $B --suite cb --widths 16,64,256 --new-tokens 256 --commit $C --json /tmp/j/cb_${v}_$i.json > /tmp/j/cb_${v}_$i.log 2>&1
    echo "== cb $v ($C) run $i: rc $? t=$(( $(date +%s) - start ))s" >> $S
    grep -E "^ +(16|64|256) |bandwidth" /tmp/j/cb_${v}_$i.log >> $S
  done
done
python3 - <<'PY'
import json,glob,os
out={os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/j/*.json'))}
json.dump(out,open(os.environ['OUT']+'/r/ab_attn_occupancy.json','w'),indent=1)
PY
tar cJf $OUT/r/logs.tar.xz -C /tmp/j $(cd /tmp/j && ls *.log)
cat $S
