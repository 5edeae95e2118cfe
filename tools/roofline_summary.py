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
# Session 26: main's kernels (3107341; the session's experiments were reverted) as the
# `bench_looped_old` binary of calls 1 and 2 — CB prompt 128 from their four runs, prompt 2048 from
# both, depth batching shared K/V from both, last-exited from call 2; Huginn from call 2's binary
# (fccc9b3, whose Huginn path — SIMT decode attention, head dim 96 — is main's code); prompt 8192
# from call 3.
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


def main():
    c1, c2 = (json.loads(f.read_text()) for f in calls)
    rows = cb_rows([c1["cb_old1"], c1["cb_old2"], c2["cb_old1"], c2["cb_old2"]], "CB, prompt 128 + 256 new", 0.75)
    rows += cb_rows([c1["cb2k_old"], c2["cb2k_old"]], "CB, prompt 2048 + 256 new", 0.75)
    rows += cb_rows([json.loads(cb8k.read_text())], "CB, prompt 8192 + 64 new", 0.75)
    rows += cb_rows([c2["huginn"]], "Huginn CB, prompt 128 + 128 new", None)
    rows += cdb_rows([c1["cdb_old"], c2["cdb_shared_old"]], "CDB refill, shared K/V (decode side)")
    rows += cdb_rows([c2["cdb_last-exited_old"]], "CDB refill, last-exited K/V (decode side)")
    doc = dict(gpu=c1["cb_old1"]["gpu"], commit="3107341 (Huginn: fccc9b3)",
               model="Ouro-1.4B shapes (Huginn-0125 where named), random bf16 weights",
               sources="docs/bench/raw-2026-12-06/{call1,call2,call3}", rows=rows)
    out = root / "docs" / "bench" / "looped_roofline.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out)
    for r in rows:
        print(f"{r['workload']:45s} W {r['width']:3d}: {100 * r['fraction']:5.1f} %")


if __name__ == "__main__":
    main()
