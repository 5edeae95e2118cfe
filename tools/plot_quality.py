#!/usr/bin/env python3
"""Plots the quality reports docs/bench/quality_*.json into .svg and .png next to them.

    python3 tools/plot_quality.py                              # both files; needs matplotlib
    python3 tools/plot_quality.py quality_tiny_sdar.json       # only this one

quality_gates_tiny_ouro.json (examples/quality_gates.rs): perplexity vs mean depth of the trained
and stock exit gates by q, and their agreement with the synchronous stock gate.
quality_tiny_ouro.json (examples/quality.rs): held-out perplexity vs realised mean depth, one
line per gate / KV layout, fixed depths 1..r_max as the reference; left panel all rows (log
scale), right panel without the shared layout. quality_tiny_sdar.json
(examples/quality_diffusion.rs): masked-token accuracy and perplexity by mask ratio; exact match
and the cross-model judge's perplexity vs tokens decoded per step, by threshold, delayed cache and
FOCUS.
"""
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "ponder"  # stable element ids in the SVGs
import matplotlib.pyplot as plt

bench = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench"


def save(fig, path):
    fig.savefig(path.with_suffix(".svg"), metadata={"Date": None})  # no timestamp: reruns on unchanged data change nothing
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", path.with_suffix(".svg"), "and .png")


def plot_ouro(path):
    doc = json.loads(path.read_text())
    rows = doc["results"]
    series = {}
    for r in rows:
        series.setdefault(f"{r['gate']} / {r['layout']}", []).append(r)
    colours = {name: f"C{i}" for i, name in enumerate(series)}  # the same colour in both panels
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, keep_shared in zip(axes, (True, False)):
        for name, rs in series.items():
            if not keep_shared and rs[0]["layout"] == "shared":
                continue
            rs = sorted(rs, key=lambda r: r["mean_depth"])
            if rs[0]["gate"] == "fixed depth":
                style = dict(color="black", ls="--", marker="s", lw=1.2)
            elif len(rs) == 1:
                style = dict(color="black", ls="none", marker="*", ms=12)
            else:
                style = dict(marker="o", ls="-", color=colours[name])
            ax.plot([r["mean_depth"] for r in rs], [r["perplexity"] for r in rs], label=name, **style)
            if rs[0]["gate"] == "fixed depth":
                for r in rs:
                    ax.annotate(f"d={r['fixed_depth']}", (r["mean_depth"], r["perplexity"]), fontsize=7,
                                textcoords="offset points", xytext=(4, -10))
        ax.set_xlabel("realised mean depth (loop steps per scored token)")
        ax.set_ylabel("held-out perplexity")
        if keep_shared:
            ax.set_yscale("log")
            ax.set_title("all configurations (log scale)", fontsize=9)
        else:
            ax.set_title("without the shared layout", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['model']}: held-out perplexity vs depth by exit threshold q "
                 f"({doc['sequences']} × {doc['scored_tokens']} scored tokens, {doc['heldout']})", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot_sdar(path):
    doc = json.loads(path.read_text())
    m = doc["masked"]["results"]
    d = doc["decoding"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ratios = [r["mask_ratio"] for r in m]
    ax.plot(ratios, [100 * r["accuracy"] for r in m], "o-", color="C0", label="accuracy (%)")
    ax.set_xlabel("mask ratio of the scored block")
    ax.set_ylabel("masked-token accuracy (%)", color="C0")
    ax2 = ax.twinx()
    ax2.plot(ratios, [r["perplexity"] for r in m], "s--", color="C3", label="perplexity")
    ax2.set_yscale("log")
    ax2.set_ylabel("masked-token perplexity (log)", color="C3")
    ax.set_title(f"held-out masked-token prediction ({doc['masked']['windows']} windows of {doc['masked']['window_tokens']})", fontsize=9)
    ax.grid(True, alpha=0.3)

    res = d["results"]
    for ax, key, ylabel in ((axes[1], "exact_match", "exact match vs true continuation (%)"),
                            (axes[2], "judge_perplexity", "tiny-Ouro judge perplexity of the continuation")):
        for delayed, focus, style, label in ((False, False, "o-", "delayed cache off"), (True, False, "s--", "delayed cache on"),
                                             (True, True, "^:", "FOCUS (α 1.5) on the delayed cache")):
            rs = sorted([r for r in res if r["delayed_cache"] == delayed and r.get("focus", False) == focus and r["tau"] is not None],
                        key=lambda r: r["tokens_per_step"])
            if not rs:
                continue
            ys = [100 * r[key] if key == "exact_match" else r[key] for r in rs]
            ax.plot([r["tokens_per_step"] for r in rs], ys, style, label=label)
            for r, y in zip(rs, ys):
                ax.annotate(f"τ={r['tau']:g}", (r["tokens_per_step"], y), fontsize=7, textcoords="offset points",
                            xytext=(4, 4 if delayed else -10))
        ref = [r for r in res if r["tau"] is None]
        for r in ref:
            y = 100 * r[key] if key == "exact_match" else r[key]
            ax.plot([r["tokens_per_step"]], [y], "k*", ms=11, label=f"{r['policy']} (one token per step)")
        if key == "exact_match":
            ax.axhline(100 * d["ouro_greedy_reference"]["exact_match"], color="grey", ls=":", label="tiny Ouro greedy (AR)")
        else:
            ax.axhline(d["judge_perplexity_true_continuation"], color="grey", ls=":", label="true continuation")
        ax.set_xlabel("tokens decoded per denoising step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_title(f"{d['prompts']} held-out prompts of {d['prompt_tokens']} tokens, {d['new_tokens']} generated", fontsize=9)
    axes[2].set_title("cross-model judge (lower = more predictable to the tiny Ouro)", fontsize=9)
    fig.suptitle(f"{doc['model']} (block {doc['block_length']}), CPU f32, seed {doc['seed']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot_gates(path):
    """Perplexity vs mean depth by threshold q for the stock gate synchronous / delayed, the
    learned lookahead and preloop, with the fixed depths; and each gate's agreement with (a)."""
    doc = json.loads(path.read_text())
    rows = doc["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    gates = [g for g in dict.fromkeys(r["gate"] for r in rows) if not g.startswith("(e)")]
    for i, g in enumerate(gates):
        rs = [r for r in rows if r["gate"] == g]
        ax.plot([r["mean_depth"] for r in rs], [r["perplexity"] for r in rs], "o-", color=f"C{i}", label=g, markersize=4)
        if not g.startswith("(a)"):
            bx.plot([r["q"] for r in rs], [100 * r["agreement_with_stock_sync"] for r in rs], "o-", color=f"C{i}", label=g, markersize=4)
    fixed = [r for r in rows if r["gate"].startswith("(e)")]
    ax.plot([r["mean_depth"] for r in fixed], [r["perplexity"] for r in fixed], "k--s", label="(e) fixed depth", markersize=4)
    ax.set_xlabel("mean loop depth per scored token")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("tiny Ouro, last-exited KV: gates by threshold q", fontsize=9)
    ax.legend(fontsize=7)
    bx.set_xlabel("threshold q")
    bx.set_ylabel("exit step = (a)'s, % of tokens")
    bx.set_title("agreement with the synchronous stock gate (a)", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def plot(path):
    doc = json.loads(path.read_text())
    if "decoding" in doc:
        plot_sdar(path)
    elif "gates" in doc:
        plot_gates(path)
    elif "results" in doc:
        plot_ouro(path)
    else:
        print("no plot for", path.name)


if __name__ == "__main__":
    names = sys.argv[1:]
    paths = [bench / n for n in names] if names else sorted(bench.glob("quality_*.json"))
    for p in paths:
        plot(p)
