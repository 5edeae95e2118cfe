#!/usr/bin/env python3
"""Plots docs/bench/*.json into docs/bench/*.svg (tokens/s by width, per mode, with the floor).

    python3 tools/plot_bench.py            # needs matplotlib
"""
import json, pathlib, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

bench = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench"

def plot_looped_cb(path):
    doc = json.loads(path.read_text())
    rows = doc["results"]
    w = [r["width"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(w, [r["tokens_per_s"] for r in rows], "o-", label="ponder CB (measured)")
    ax.plot(w, [r["floor_tokens_per_s"] for r in rows], "k--", label="weight-streaming floor")
    ref = {16: 900, 64: 2950, 256: 6900}
    ax.plot(list(ref), list(ref.values()), "s:", label="PyTorch + CUDA graphs (issue ref.)")
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xlabel("decode width W (requests)"); ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{doc['model']}\n{doc['gpu']}, commit {doc['commit']}", fontsize=9)
    ax.legend(fontsize=8); ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = path.with_suffix(".svg")
    fig.savefig(out); fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", out)

for p in sorted(bench.glob("*.json")):
    if p.stem.startswith("looped_cb"):
        plot_looped_cb(p)


def plot_looped_cdb(path):
    doc = json.loads(path.read_text())
    rows = doc["results"]
    depths = sorted({r["target_mean_depth"] if "target_mean_depth" in r else r["mean_depth"] for r in rows if r["mode"] != "cb"})
    fig, axes = plt.subplots(1, len(depths), figsize=(5.5 * len(depths), 4), squeeze=False)
    for ax, d in zip(axes[0], depths):
        for mode, style in [("cdb-no-refill", "s--"), ("cdb-refill", "o-")]:
            pts = [r for r in rows if r["mode"] == mode and r.get("target_mean_depth") == d]
            ax.plot([r["width"] for r in pts], [r["speedup_vs_cb"] for r in pts], style, label=f"{mode} speed-up")
        pts = [r for r in rows if r["mode"] == "cdb-refill" and r.get("target_mean_depth") == d]
        ax.plot([r["width"] for r in pts], [r["flop_bound"] for r in pts], "k:", label="FLOP bound")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("width W"); ax.set_ylabel("tokens/s ÷ CB tokens/s")
        ax.set_title(f"replayed mean depth {d} of 4", fontsize=9)
        ax.legend(fontsize=8); ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{doc['model']} — {doc['gpu']}, commit {doc['commit']}, layout {doc.get('layout')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".svg")); fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", path.with_suffix(".svg"))


for p in sorted(bench.glob("*.json")):
    if p.stem.startswith("looped_cdb"):
        plot_looped_cdb(p)


def plot_quality(path):
    doc = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {}
    for r in doc["results"]:
        series.setdefault(f"{r['gate']} / {r['layout']}", []).append(r)
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r["mean_depth"])
        ax.plot([r["mean_depth"] for r in rs], [r["perplexity"] for r in rs], "o-", label=name)
    ax.set_xlabel("realised mean depth (loop steps per token)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"{doc['model'].split('/')[-1]}: quality vs depth by exit threshold q", fontsize=9)
    ax.legend(fontsize=7); ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".svg")); fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", path.with_suffix(".svg"))


for p in sorted(bench.glob("quality*.json")):
    plot_quality(p)
