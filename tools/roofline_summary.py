#!/usr/bin/env python3
"""Collects the looped decode's roofline figures from raw device runs into
docs/bench/looped_roofline.json (one row per workload and width: step time, roofline time, the
fraction reached, the issue's target, and the raw file and command each came from).

    python3 tools/roofline_summary.py     # then: python3 tools/plot_bench.py looped_roofline.json
"""
import json
import pathlib
import statistics

root = pathlib.Path(__file__).resolve().parent.parent
raw = root / "docs" / "bench" / "raw-2026-12-02f"
# Session 22: decode projections split over k (call 2, f0db27f: the same plan for Ouro as main's
# tile rule), Huginn at 11777af (runs whole, call 3), last-exited depth batching at 02cba0c
# (call 4: main + unrolled partial loads, measured level and reverted).
split_k = raw / "split_k_f0db27f" / "ab_split_k.json"
tiles = raw / "tiles_l2_breakdown_11777af" / "runs.json"
loads = raw / "parts_loads_02cba0c" / "runs.json"

def cb_rows(runs, workload, target):
    """Rows of suite-cb results (several runs of one binary: the mean)."""
    out = []
    for i, r in enumerate(runs[0]["results"]):
        same = [run["results"][i] for run in runs]
        mean = lambda k: statistics.mean(x[k] for x in same)
        out.append(dict(workload=workload, model=runs[0]["model"], width=r["width"], decode_tokens_per_s=mean("tokens_per_s"),
                        step_ms=mean("decode_step_ms"), roofline_ms=mean("decode_roofline_step_ms"), fraction=mean("fraction_of_roofline"),
                        target=target, runs=len(same), commit=runs[0]["commit"], commands=[run["command"] for run in runs]))
    return out


def cdb_rows(docs, workload):
    """Depth batching's decode side (core + coda device time against their roofline time), the
    mean over the runs given."""
    runs = [[r for r in d["results"] if r["mode"] == "cdb-refill"] for d in docs]
    out = []
    for i, r in enumerate(runs[0]):
        same = [rs[i] for rs in runs]
        side = [(x["stages"]["core"]["roofline_s"] + x["stages"]["coda"]["roofline_s"]) / (x["stages"]["core"]["device_s"] + x["stages"]["coda"]["device_s"]) for x in same]
        mean = lambda k: statistics.mean(x[k] for x in same)
        out.append(dict(workload=workload, model=docs[0]["model"], width=r["width"], decode_tokens_per_s=mean("tokens_per_s"), step_ms=None, roofline_ms=None,
                        fraction=statistics.mean(side), target=0.70, speedup_vs_cb=mean("speedup_vs_cb"),
                        fraction_of_prefill_adjusted_bound=mean("fraction_of_prefill_adjusted_bound"), runs=len(same), commit=docs[0]["commit"],
                        commands=[d["command"] for d in docs]))
    return out


def main():
    ab, t3, c4 = (json.loads(f.read_text()) for f in (split_k, tiles, loads))
    rows = cb_rows([ab["cb_B_1"], ab["cb_B_2"]], "CB, prompt 128 + 256 new", 0.75)
    rows += cb_rows([ab["cb2k_B"]], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([t3["huginn_B"]], "Huginn CB, prompt 128 + 128 new", None)
    rows += cdb_rows([ab["cdb_B"]], "CDB refill, shared K/V (decode side)")
    rows += cdb_rows([c4["cdb_last-exited"]], "CDB refill, last-exited K/V (decode side)")
    doc = dict(gpu=ab["cb_B_1"]["gpu"], commit="f0db27f, 11777af, 02cba0c (rows name theirs)",
               model="Ouro-1.4B shapes (Huginn-0125 where named), random bf16 weights",
               sources="docs/bench/raw-2026-12-02f/{split_k_f0db27f,tiles_l2_breakdown_11777af,parts_loads_02cba0c}", rows=rows)
    out = root / "docs" / "bench" / "looped_roofline.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out)
    for r in rows:
        print(f"{r['workload']:45s} W {r['width']:3d}: {100 * r['fraction']:5.1f} %")


if __name__ == "__main__":
    main()
