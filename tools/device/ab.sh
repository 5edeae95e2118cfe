#!/usr/bin/env bash
# A/B/A/B on the device machine: the same benchmark with the binaries of two commits, alternated,
# so drift of the machine (clocks, temperature) falls on both alike. The device returns at most
# eight files, so every run's JSON is merged into one.
#
#     tools/device/ab.sh NAME ROUNDS BINARY ARGS...
#
# Runs `.device/old/BINARY ARGS --json …` then `.device/new/BINARY ARGS --json …`, ROUNDS times,
# and writes $OUT/NAME.json: {"binary", "args", "runs": [{"variant", "round", "result"}]}.
# The binaries come from `tools/device/pack.sh` at each commit, copied into .device/old and
# .device/new; unpack them first with `source tools/device/unpack_ab.sh`.
set -euo pipefail
name=$1 rounds=$2 bin=$3
shift 3
tmp=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    echo "== $name round $r: $v" >&2
    ".device/$v/$bin" "$@" --json "$tmp/${v}_$r.json" >&2
  done
done
python3 - "$tmp" "$OUT/$name.json" "$bin" "$*" "$rounds" <<'PY'
import json, sys
tmp, out, binary, args, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
runs = [{"variant": v, "round": r, "result": json.load(open(f"{tmp}/{v}_{r}.json"))} for r in range(1, rounds + 1) for v in ("old", "new")]
json.dump({"binary": binary, "args": args, "runs": runs}, open(out, "w"), indent=1)
PY
