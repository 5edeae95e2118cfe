#!/usr/bin/env bash
# A live-load sweep on the GPU machine: latency against rate for several serving modes of one
# model, at rates placed around the first mode's knee.
#
#   tools/device/live_load.sh OUT "MODES" "FRACTIONS" [bench_serving arguments...]
#   tools/device/live_load.sh $OUT/ouro_w64 "cb cdb-refill" "0.25 0.5 0.75 1.0 1.2" \
#       --shapes ouro-1.4b --cuda --width 64 --workload sharegpt
#
# Every mode drains a burst first (all `POOL` requests, default 256, at t = 0): its completed
# requests/s is the mode's knee. The first mode's knee times each FRACTION gives the rates every
# mode runs, so all modes share them; Poisson traces cycle through the same pool. One JSON per
# mode, OUT_<mode>.json, its burst row first. `RATES=a,b,...` gives the rates instead (every mode
# then runs its burst and them in one process). `BENCH` names the binary (.device/bench_serving).
set -euo pipefail
out=$1 modes=$2 fractions=$3
shift 3
bench=${BENCH:-.device/bench_serving}
pool=${POOL:-256}
rates=${RATES:-}
for mode in $modes; do
  if [ -n "$rates" ]; then
    "$bench" --mode "$mode" --requests "$pool" --rates "burst,$rates" --json "${out}_${mode}.json" "$@"
    continue
  fi
  # The first mode's knee places the rates: its burst runs on its own first.
  "$bench" --mode "$mode" --requests "$pool" --rates burst --json "${out}_${mode}_burst.json" "$@"
  knee=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["runs"][0]["summary"]["request_throughput"])' "${out}_${mode}_burst.json")
  rates=$(python3 -c 'import sys; k=float(sys.argv[1]); print(",".join(f"{k*float(f):.2f}" for f in sys.argv[2:]))' "$knee" $fractions)
  echo "knee of $mode: $knee req/s; rates: $rates"
  "$bench" --mode "$mode" --requests "$pool" --rates "$rates" --json "${out}_${mode}_rates.json" "$@"
  python3 -c '
import json, sys
burst, rates = (json.load(open(p)) for p in sys.argv[1:3])
rates["runs"] = burst["runs"] + rates["runs"]
rates["burst_command"] = burst["command"]
json.dump(rates, open(sys.argv[3], "w"), indent=1)' "${out}_${mode}_burst.json" "${out}_${mode}_rates.json" "${out}_${mode}.json"
  rm "${out}_${mode}_burst.json" "${out}_${mode}_rates.json"
done
