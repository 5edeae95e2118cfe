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
raw = root / "docs" / "bench" / "raw-2026-12-01c"
# The CB rows at Ouro-1.4B shapes: session 20's kept attention split plan (call 4).
cb_raw = root / "docs" / "bench" / "raw-2026-12-02d" / "attn_split_kept_a9887ae"


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
    new_runs = [json.loads((cb_raw / f"cb_N_{i}.json").read_text()) for i in (1, 2)]
    rows = cb_rows(new_runs, "CB, prompt 128 + 256 new", 0.75)
    rows += cb_rows([json.loads((cb_raw / "cb2k_N.json").read_text())], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([json.loads((raw / "attn_split_6303cb0" / "huginn_cb.json").read_text())], "Huginn CB, prompt 128 + 128 new", None)
    rows += cdb_rows([json.loads((raw / "attn_split_6303cb0" / "cdb_shared.json").read_text())], "CDB refill, shared K/V (decode side)")
    le = json.loads((raw / "last_exited_fill_7da0c67" / "ab_last_exited_fill.json").read_text())
    rows += cdb_rows([run["result"] for run in le["runs"] if run["variant"] == "new"], "CDB refill, last-exited K/V (decode side)")
    doc = dict(gpu=new_runs[0]["gpu"], commit=f"CB rows {new_runs[0]['commit']}; Huginn and shared CDB rows 6303cb0; last-exited row {le['new']}",
               model="Ouro-1.4B shapes (Huginn-0125 where named), random bf16 weights",
               sources="docs/bench/raw-2026-12-02d/attn_split_kept_a9887ae (CB), docs/bench/raw-2026-12-01c/{attn_split_6303cb0,last_exited_fill_7da0c67}", rows=rows)
    out = root / "docs" / "bench" / "looped_roofline.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out)
    for r in rows:
        print(f"{r['workload']:45s} W {r['width']:3d}: {100 * r['fraction']:5.1f} %")


if __name__ == "__main__":
    main()
