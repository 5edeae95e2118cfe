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
raw23 = root / "docs" / "bench" / "raw-2026-12-02g"
# Session 23 (main at 2442fb3: greedy readout in one launch, SiLU·mul vectors): CB prompt 128 from
# the six runs of main's binary in calls 1, 4 and 5, prompt 2048 from calls 4 and 5, depth
# batching on shared K/V from call 1. Session 22 still stands for Huginn (11777af, call 3) and
# last-exited depth batching (02cba0c, call 4).
main23 = [raw23 / d / "runs.json" for d in ("greedy_silu_2442fb3", "attention_47a84e5", "attention_halves_5dbb0a7")]
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
    c1, c4, c5 = (json.loads(f.read_text()) for f in main23)
    t3, l4 = (json.loads(f.read_text()) for f in (tiles, loads))
    rows = cb_rows([c1["cb_new1"], c1["cb_new2"], c4["cb_old1"], c4["cb_old2"], c5["cb_old1"], c5["cb_old2"]], "CB, prompt 128 + 256 new", 0.75)
    rows += cb_rows([c4["cb2k_old"], c5["cb2k_old"]], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([t3["huginn_B"]], "Huginn CB, prompt 128 + 128 new", None)
    rows += cdb_rows([c1["cdb_new"]], "CDB refill, shared K/V (decode side)")
    rows += cdb_rows([l4["cdb_last-exited"]], "CDB refill, last-exited K/V (decode side)")
    doc = dict(gpu=c1["cb_new1"]["gpu"], commit="2442fb3, 11777af, 02cba0c (rows name theirs)",
               model="Ouro-1.4B shapes (Huginn-0125 where named), random bf16 weights",
               sources="docs/bench/raw-2026-12-02g/{greedy_silu_2442fb3,attention_47a84e5,attention_halves_5dbb0a7}, "
               "docs/bench/raw-2026-12-02f/{tiles_l2_breakdown_11777af,parts_loads_02cba0c}", rows=rows)
    out = root / "docs" / "bench" / "looped_roofline.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out)
    for r in rows:
        print(f"{r['workload']:45s} W {r['width']:3d}: {100 * r['fraction']:5.1f} %")


if __name__ == "__main__":
    main()
