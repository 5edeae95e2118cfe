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
raw = root / "docs" / "bench" / "raw-2026-12-06"
# Session 30. CB prompt 128 at W 16 / 64 / 256, W 24 and prompt 2048 at W 16 from d76afbb (main: the
# SIMT kernel's 8-warp builds for one even wave, the ring from 33 rows), call 6; W 32 from fada648
# with PONDER_DECODE_RING=0 (what d76afbb runs by default there), call 5; depth batching (shared
# K/V) from 2d78dc2 (the 8-warp build), call 2. Session 28: W 48 and prompt 2048 at W 32 / 64 from 4929672, call 3; depth
# batching on last-exited K/V from c035156 (the fold), call 2. Prompt 8192 and Huginn (no ring:
# 55 heads, head dim 96) from 3107341 / fccc9b3 (session 26), not re-run since. The prefill row: CB's prefill
# stage in session 30's depth-batching runs (2d78dc2, call 2), compute-bound, against the measured matmul peak.
new = root / "docs" / "bench" / "raw-2026-12-08"
s28 = [new / c / "runs.json" for c in ("call2", "call3")]
s30 = [root / "docs" / "bench" / "raw-2026-12-10" / c / "runs.json" for c in ("call2", "call5", "call6")]
calls = [raw / c / "runs.json" for c in ("call1", "call2")]
cb8k = raw / "call3" / "cb8k.json"

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


def prefill_rows(docs, workload):
    """CB's prefill in the depth-batching runs (compute-bound at W 64: its roofline time is FLOPs
    over the measured bf16 matmul peak, so the fraction is the share of the peak reached), the
    mean over the runs given."""
    out = []
    runs = [[r for r in d["results"] if r["mode"] == "cb"] for d in docs]
    for i, r in enumerate(runs[0]):
        same = [rs[i]["stages"]["prefill"] for rs in runs]
        out.append(dict(workload=workload, model=docs[0]["model"], width=r["width"], decode_tokens_per_s=None, step_ms=None, roofline_ms=None,
                        fraction=statistics.mean(x["roofline_s"] / x["device_s"] for x in same),
                        prefill_tflops=statistics.mean(x["flops"] / x["device_s"] / 1e12 for x in same),
                        matmul_peak_tflops=statistics.mean(d["matmul_peak_tflops"] for d in docs), target=None, runs=len(same),
                        commit=docs[0]["commit"], commands=[d["command"] for d in docs]))
    return out


def main():
    c1, c2 = (json.loads(f.read_text()) for f in calls)
    n2, n3 = (json.loads(f.read_text()) for f in s28)
    m2, m5, m6 = (json.loads(f.read_text()) for f in s30)
    rows = cb_rows([m6["cb"]], "CB, prompt 128 + 256 new", 0.75)
    between = "CB, prompt 128 + 256 new (widths between)"
    rows += cb_rows([m6["cb24"]], between, None)
    rows += cb_rows([m5["cb32_simt1"], m5["cb32_simt2"]], between, None)
    rows += cb_rows([n3["w48_new1"], n3["w48_new2"]], between, None)
    rows += cb_rows([m6["cb2k"]], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([n3["cb2k32_new1"], n3["cb2k32_new2"]], "CB, prompt 2048 + 256 new", None)
    rows += cb_rows([n3["cb2k64_new1"], n3["cb2k64_new2"]], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([json.loads(cb8k.read_text())], "CB, prompt 8192 + 64 new", 0.75)
    rows += cb_rows([c2["huginn"]], "Huginn CB, prompt 128 + 128 new", None)
    rows += cdb_rows([m2["cdb_new1"], m2["cdb_new2"]], "CDB refill, shared K/V (decode side)")
    rows += cdb_rows([n2["cdb_last-exited_new1"], n2["cdb_last-exited_new2"]], "CDB refill, last-exited K/V (decode side)")
    rows += prefill_rows([m2["cdb_new1"], m2["cdb_new2"]], "CB prefill, prompts ≤ 512 (of the bf16 matmul peak)")
    doc = dict(gpu=m6["cb"]["gpu"], commit="d76afbb / fada648 / 2d78dc2 / 4929672 / c035156 (each row names its own)",
               model="Ouro-1.4B shapes (Huginn-0125 where named), random bf16 weights",
               sources="docs/bench/raw-2026-12-10/{call2,call5,call6}, docs/bench/raw-2026-12-08/{call2,call3}, docs/bench/raw-2026-12-06/{call2,call3}", rows=rows)
    out = root / "docs" / "bench" / "looped_roofline.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out)
    for r in rows:
        print(f"{r['workload']:45s} W {r['width']:3d}: {100 * r['fraction']:5.1f} %")


if __name__ == "__main__":
    main()
