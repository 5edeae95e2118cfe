# What every device call script shares. Source it from the call's script, on the device:
#
#     source tools/device/call.sh "$0"        # first line after `set -u`
#     tests 230 decode_ cuda_graphs            # gpu_kernels [filters]
#     bench cb16_new 40 .device/bench_looped --suite cb --widths 16 --new-tokens 256
#     bench cb16_deep 40 .device/bench_looped --suite cb --widths 16 --kernels simt-deep=two
#     run smi 10 nvidia-smi                      # any command: its log and exit status
#     save; cat "$S"
#
# It unpacks the carried binaries (.device/*.xz), copies the calling script to $OUT/r/call.sh
# (and itself to call_lib.sh),
# starts $OUT/r/summary.txt ($S) with the GPU's clocks, and keeps every log under $J. `bench`
# passes `--commit $C --json $J/LABEL.json` (C: the commit the binary was packed at; a binary kept
# aside from another commit takes its own through `C=… bench …`), `save` writes every JSON into
# $OUT/r/runs.json (one key a label) and every log into $OUT/r/logs.tar.xz (no xz binary on the
# device: Python's lzma). Each command runs under `timeout` and appends `== LABEL rc N t=Ss` and
# the log's headline lines to the summary, so a call cut short still returns what finished.
J=${J:-/tmp/j}
S=$OUT/r/summary.txt
# A warm machine may hold an earlier call's files: a run cut off before writing its JSON must not
# be stood in for by an older one of the same label.
rm -rf "$J"
mkdir -p "$OUT/r" "$J"
cp "$1" "$OUT/r/call.sh"
cp tools/device/call.sh "$OUT/r/call_lib.sh"  # the raw folder then holds every line that ran
source .device/unpack.sh
call_start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$S" 2>&1

# Seconds since the call started.
elapsed() { echo $(($(date +%s) - call_start)); }

# run LABEL TIMEOUT CMD...: CMD's output to $J/LABEL.log; its status and headline lines to $S.
run() {
  local label=$1 limit=$2 rc
  shift 2
  timeout -k 10 "$limit" "$@" > "$J/$label.log" 2>&1
  rc=$?
  echo "== $label rc $rc t=$(elapsed)s" >> "$S"
  grep -E "test result|panicked|FAILED|^ +[0-9]+ |cdb-refill|rror|^W +[0-9]+ ctx" "$J/$label.log" | head -30 >> "$S"
  return 0
}

# tests TIMEOUT [FILTER...]: the device test suite, one test at a time. Run in parallel (a thread
# a test, each on a CUDA device of its own in one context) the suite has failed a test that
# passes alone and then died of a segmentation fault (H100 at e0fa080, H200 at 39be911); one at a
# time it passes on both cards (about 3 minutes on the H100, 5 on the H200).
tests() {
  local limit=$1
  shift
  run tests "$limit" .device/gpu_kernels --test-threads 1 "$@"
}

# bench LABEL TIMEOUT [env VAR=V…] BINARY ARGS...: a benchmark run with its commit and JSON.
bench() {
  local label=$1 limit=$2
  shift 2
  run "$label" "$limit" "$@" --commit "${C:?set C to the packed commit}" --json "$J/$label.json"
}

# save: every JSON so far into runs.json, every log into logs.tar.xz.
save() {
  python3 - "$J" "$OUT/r" "$S" <<'PY'
import glob, io, json, lzma, os, sys, tarfile
work, out, summary = sys.argv[1:4]
runs, broken = {}, []
for f in sorted(glob.glob(f"{work}/*.json")):
    try:
        runs[os.path.basename(f)[:-5]] = json.load(open(f))
    except ValueError:
        broken.append(os.path.basename(f))  # a run cut off while writing
if broken:
    open(summary, "a").write(f"== save: unreadable JSON left out: {' '.join(broken)}\n")
json.dump(runs, open(f"{out}/runs.json", "w"), indent=1)
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    for f in sorted(glob.glob(f"{work}/*.log")):
        tar.add(f, arcname=os.path.basename(f))
open(f"{out}/logs.tar.xz", "wb").write(lzma.compress(buf.getvalue()))
PY
}
