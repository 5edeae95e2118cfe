#!/usr/bin/env python3
"""Plots the trained-gate overlap comparison (bench_looped --suite cdb --depth-traces): tokens/s
of the synchronous stock gate, the delayed stock gate with overlap and the learned lookahead with
overlap, per width, one panel per run file.

    python3 tools/gate_overlap_plot.py docs/bench/gate_overlap_q0.2_steady.json \
        docs/bench/gate_overlap_q0.2.json docs/bench/gate_overlap_q0.5.json --out docs/bench/gate_overlap
"""
import argparse
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = [("stock-sync", "(a) stock, synchronous"), ("delayed", "(b) stock delayed, overlap"), ("learned", "(c) learned lookahead, overlap")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True, help="path without extension; writes .svg and .png")
    args = ap.parse_args()
    fig, axes = plt.subplots(1, len(args.files), figsize=(4.6 * len(args.files), 3.8), squeeze=False)
    for ax, path in zip(axes[0], args.files):
        d = json.load(open(path))
        q = re.search(r"/q([0-9.]+)/", d["command"]).group(1)
        rpw = re.search(r"--requests-per-width (\d+)", d["command"]).group(1)
        rows = [r for r in d["results"] if r["mode"] == "cdb-refill"]
        widths = sorted({r["width"] for r in rows})
        for i, (src, label) in enumerate(SOURCES):
            ys = [next((r["tokens_per_s"] for r in rows if r["width"] == w and r["depth_source"] == src), 0) for w in widths]
            xs = [j + (i - 1) * 0.27 for j in range(len(widths))]
            bars = ax.bar(xs, ys, width=0.27, label=label)
            for b, r in zip(bars, [next(r for r in rows if r["width"] == w and r["depth_source"] == src) for w in widths]):
                ax.annotate(f"d̄ {r['mean_depth']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(widths)), [f"W {w}" for w in widths])
        ax.set_title(f"q = {q}, {rpw} requests per width ({d['commit']})", fontsize=9)
        ax.set_ylabel("tokens/s (Ouro-1.4B shapes, H200)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out + ".svg")
    fig.savefig(args.out + ".png", dpi=110)
    print(f"wrote {args.out}.svg / .png")


if __name__ == "__main__":
    main()
