#!/usr/bin/env python3
"""Summarises A/B/A/B device runs (tools/device/ab.sh) of old and new binaries: per figure the
tokens/s of each run, the mean of each variant and new ÷ old, as a markdown table, a summary
JSON and a plot (needs matplotlib).

    python3 tools/ab_table.py OUT_STEM RUN.json [RUN.json ...]

writes OUT_STEM.json, OUT_STEM.svg and OUT_STEM.png; prints the table.
"""
import json, pathlib, statistics, sys


def figures(result):
    """(label, tokens/s) of every row of one benchmark JSON."""
    for r in result["results"]:
        if "batch" in r:  # bench_diffusion
            yield f"diffusion B={r['batch']} {r['mode']}", r["tokens_per_s"]
        elif "mean_depth" in r:  # bench_looped --suite cdb
            mode = r["mode"] + ("/overlap" if r.get("overlap") else "")
            yield f"cdb W={r['width']} {mode}", r["tokens_per_s"]
        else:  # bench_looped --suite cb
            yield f"cb W={r['width']}", r["tokens_per_s"]


def main():
    stem, files = pathlib.Path(sys.argv[1]), sys.argv[2:]
    rows, meta = [], []
    for f in files:
        doc = json.loads(pathlib.Path(f).read_text())
        per = {}
        for run in doc["runs"]:
            for label, tps in figures(run["result"]):
                per.setdefault(label, {"old": [], "new": []})[run["variant"]].append(tps)
        first = {v: next(r["result"] for r in doc["runs"] if r["variant"] == v) for v in ("old", "new")}
        meta.append({"file": pathlib.Path(f).name, "binary": doc["binary"], "args": doc["args"], "gpu": first["new"].get("gpu"),
                     "old_commit": first["old"].get("commit"), "new_commit": first["new"].get("commit")})
        for label, v in per.items():
            old, new = statistics.mean(v["old"]), statistics.mean(v["new"])
            rows.append({"figure": label, "old": v["old"], "new": v["new"], "old_mean": old, "new_mean": new, "ratio": new / old})
    print("| figure | old tokens/s (runs) | new tokens/s (runs) | new ÷ old |")
    print("|---|---|---|---|")
    for r in rows:
        fmt = lambda xs: " / ".join(f"{x:.0f}" for x in xs)
        print(f"| {r['figure']} | {fmt(r['old'])} | {fmt(r['new'])} | {r['ratio']:.3f} |")
    stem.with_suffix(".json").write_text(json.dumps({"runs": meta, "figures": rows}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        matplotlib.rcParams["svg.hashsalt"] = "ponder"
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    y = range(len(rows))
    ax.barh(list(y), [100 * (r["ratio"] - 1) for r in rows], color="tab:blue")
    ax.axvspan(-3, 3, color="tab:green", alpha=0.12, label="±3 %")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(list(y), [r["figure"] for r in rows], fontsize=8)
    ax.set_xlim(-5, 5)
    ax.set_xlabel("new ÷ old − 1 (%), mean of the alternated runs")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    fig.tight_layout()
    for ext in ("svg", "png"):
        fig.savefig(stem.with_suffix("." + ext), dpi=110)


if __name__ == "__main__":
    main()
