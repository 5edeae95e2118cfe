#!/usr/bin/env bash
# A/B/A/B on the device machine: the same benchmark with the binaries of two commits, alternated,
# so drift of the machine (clocks, temperature) falls on both alike. The device returns at most
# eight files, so every run's JSON is merged into one, rewritten after each run (a call stopped
# at its time limit still returns the runs that finished).
#
#     tools/device/ab.sh NAME ROUNDS BINARY ARGS...
#
# Runs `.device/old/BINARY ARGS --json …` then `.device/new/BINARY ARGS --json …`, ROUNDS times,
# into $OUT/NAME.json: {"binary", "args", "runs": [{"variant", "round", "result"}]}.
# The binaries come from `tools/device/pack.sh` at each commit, copied into .device/old and
# .device/new; unpack them first with `source tools/device/unpack_ab.sh`.
set -euo pipefail
name=$1 rounds=$2 bin=$3
shift 3
tmp=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    echo "== $name round $r: $v" >&2
    ".device/$v/$bin" "$@" --json "$tmp/${r}_$v.json" >&2
    python3 - "$tmp" "$OUT/$name.json" "$bin" "$*" <<'PY'
import glob, json, os, sys
tmp, out, binary, args = sys.argv[1:5]
runs = []
for f in sorted(glob.glob(f"{tmp}/*.json")):
    r, v = os.path.basename(f)[:-5].split("_")
    runs.append({"variant": v, "round": int(r), "result": json.load(open(f))})
runs.sort(key=lambda x: (x["round"], x["variant"] != "old"))
json.dump({"binary": binary, "args": args, "runs": runs}, open(out, "w"), indent=1)
PY
  done
done
