#!/usr/bin/env python3
"""Prints the markdown tables of docs/BENCHMARKS.md from docs/bench/*.json."""
import json, pathlib

bench = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench"

def cb(name="looped_cb.json"):
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    print(f"| W | tokens/s | decode step ms | weight-streaming bound tokens/s | share of bound |")
    print("|---|---|---|---|---|")
    for r in d["results"]:
        print(f"| {r['width']} | {r['tokens_per_s']:.0f} | {r['decode_step_ms']:.2f} | {r['floor_tokens_per_s']:.0f} | {100*r['tokens_per_s']/r['floor_tokens_per_s']:.1f} % |")

def decode_seconds(r):
    st = r["stages"]
    return sum(v["seconds"] for k, v in st.items() if k != "prefill")

def cdb(name="looped_cdb.json"):
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    rows = d["results"]
    cb_rows = {r["width"]: r for r in rows if r["mode"] == "cb"}
    print("| W | d̄ | mode | tokens/s | speed-up vs CB | FLOP bound | share of bound | decode-only speed-up | prefill share of CB time | GPU idle ≤ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mode"] == "cb" and r["mean_depth"] != rows[0]["mean_depth"]:
            continue
        c = cb_rows[r["width"]]
        dec = decode_seconds(c) / decode_seconds(r)
        pre = c["stages"]["prefill"]["seconds"] / sum(v["seconds"] for v in c["stages"].values())
        sp = r["speedup_vs_cb"] or 1.0
        frac = r["fraction_of_bound"] if r["mode"] != "cb" else None
        dm = "4 (full)" if r["mode"] == "cb" else f"{r['mean_depth']:.2f}"
        bound = "—" if r["mode"] == "cb" else f"{r['flop_bound']:.3f}"
        print(f"| {r['width']} | {dm} | {r['mode']} | {r['tokens_per_s']:.0f} | {sp:.3f}× | {bound} | "
              f"{'' if frac is None else f'{100*frac:.1f} %'} | {dec:.3f}× | {100*pre:.0f} % | {100*r['gpu_idle']:.0f} % |")

import sys
for name in sys.argv[1:] or ["looped_cb.json", "looped_cdb.json"]:
    (cb if name.startswith("looped_cb") else cdb)(name)
    print()
