#!/usr/bin/env python3
"""Plots `bench_looped --suite cb --long-prompts` (one JSON): per budget, the short requests'
decode tokens/s and longest token gap while the long prompts prefill, and the long requests'
time to first token.

    python3 tools/long_prompt_plot.py RUN.json OUT_STEM     # writes OUT_STEM.png / .svg
"""
import json, pathlib, sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    doc = json.loads(pathlib.Path(sys.argv[1]).read_text())
    stem = pathlib.Path(sys.argv[2])
    rows = doc["results"]
    labels = [f"W={r['width']}\n{r['budget']}" for r in rows]
    panels = [
        ("short decode tok/s\nwhile prefilling", [r["short_decode_tokens_per_s"] for r in rows]),
        ("short requests' longest\ntoken gap (ms)", [r["short_max_gap_ms"] for r in rows]),
        ("long TTFT (s):\nmean (bar), max (dot)", [sum(r["long_ttft_s"]) / len(r["long_ttft_s"]) for r in rows]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(labels, values, color=["#4c72b0" if r["budget"] != "unchunked" else "#999999" for r in rows])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}" if v >= 10 else f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    axes[2].plot(labels, [max(r["long_ttft_s"]) for r in rows], "o", color="#c44e52")
    fig.suptitle(f"{doc['model']} on {doc['gpu']} @ {doc['commit']}: long prompts {rows[0]['long_prompts']} among short requests", fontsize=9)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(stem.with_suffix("." + ext), dpi=110)


if __name__ == "__main__":
    main()
