#!/usr/bin/env python3
"""Plots docs/bench/*.json into docs/bench/*.svg and *.png.

    python3 tools/plot_bench.py                        # every known file; needs matplotlib
    python3 tools/plot_bench.py looped_cdb.json looped_huginn.json   # only these

looped_cb*: tokens/s by width with the weight-streaming floor. looped_cdb* / looped_huginn*:
speed-up over CB by width, one panel per mean exit depth, one line per mode (× overlap, or ×
min coda batch for Huginn), FLOP bound dashed, prefill-adjusted bound dotted (runs with device spans). quality*: tools/plot_quality.py. diffusion*:
tokens/s by batch per mode with the reference points, and the phase breakdown of one step.
looped_roofline: the fraction of the roofline per workload and width (tools/roofline_summary.py).
"""
import json, pathlib, sys
import matplotlib
matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "ponder"  # stable element ids in the SVGs
import matplotlib.pyplot as plt
from bench_tables import coda_relative, prefill_adjusted_bound

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


def plot_looped_cdb_old(path):
    """Files before overlap rows (2026-11-28 and earlier)."""
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



SVG_META = {"Date": None}  # no timestamp in the SVG: regenerating unchanged data changes nothing


def save(fig, path):
    fig.savefig(path.with_suffix(".svg"), metadata=SVG_META)
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)
    print("wrote", path.with_suffix(".svg"), "and .png")


def header(doc):
    w = doc.get("workload")
    lengths = f"\nprompt median {w['prompt']['median']:g} (≤ {w['prompt']['max']}), output median {w['output']['median']:g} (≤ {w['output']['max']}) tokens" if w else ""
    return f"{doc['model']} — {doc['gpu']}, commit {doc['commit']}, {doc.get('date', '')}, layout {doc.get('layout')}{lengths}"


def prefill_adjusted(rows, at):
    """(width, prefill-adjusted bound) for a depth's rows; [] without `--time-device`."""
    out = []
    for w in sorted({r["width"] for r in at if r["mode"] != "cb"}):
        srcs = {r.get("source") for r in at if r["width"] == w and r["mode"] != "cb"}
        cbs = [r for r in rows if r["mode"] == "cb" and r["width"] == w]
        cb = next((r for r in cbs if r.get("source") in srcs), cbs[0] if cbs else None)
        bound = cb and prefill_adjusted_bound(cb, max(r["flop_bound"] for r in at if r["width"] == w and r["mode"] != "cb"))
        if bound is not None:
            out.append((w, bound))
    return out


def plot_looped_cdb(path):
    """Speed-up over CB vs width; a panel per mean depth; a line per mode × overlap."""
    doc = json.loads(path.read_text())
    rows = doc["results"]
    if not any("overlap" in r for r in rows):
        return plot_looped_cdb_old(path)
    depths = sorted({r["target_mean_depth"] for r in rows})
    ref = {r["width"]: r["tokens_per_s"] for r in rows
           if r["mode"] == "cdb-refill" and r.get("overlap") and r["target_mean_depth"] == 4.0}
    styles = [("cdb-no-refill", False, "s--", "tab:gray"), ("cdb-no-refill", True, "s--", "tab:blue"),
              ("cdb-refill", False, "o-", "tab:orange"), ("cdb-refill", True, "o-", "tab:red")]
    fig, axes = plt.subplots(1, len(depths), figsize=(max(5.2 * len(depths), 8.5), 4.3), squeeze=False)
    for ax, t in zip(axes[0], depths):
        at = [r for r in rows if r["target_mean_depth"] == t]
        for mode, ov, st, color in styles:
            pts = sorted((r for r in at if r["mode"] == mode and bool(r.get("overlap")) == ov), key=lambda r: r["width"])
            if pts:
                ax.plot([r["width"] for r in pts], [r["speedup_vs_cb"] for r in pts], st, color=color,
                        label=f"{mode}{' + overlap' if ov else ''}")
        bound = sorted(((r["width"], r["flop_bound"]) for r in at if r["mode"] != "cb"), key=lambda x: x[0])
        bw = sorted({w for w, _ in bound})
        ax.plot(bw, [max(b for w2, b in bound if w2 == w) for w in bw], "k--", lw=1.2, label="FLOP bound")
        adj = prefill_adjusted(rows, at)
        if adj:
            ax.plot([w for w, _ in adj], [x for _, x in adj], "k:", lw=1.2, label="prefill-adjusted bound")
        if t < 4.0 and ref:
            strict = sorted((r["width"], r["tokens_per_s"] / ref[r["width"]]) for r in at
                            if r["mode"] == "cdb-refill" and r.get("overlap") and r["width"] in ref)
            ax.plot([w for w, _ in strict], [x for _, x in strict], "*", ms=11, color="darkred",
                    label="refill + overlap ÷ itself at d̄ = 4")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["width"] for r in at}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("width W (max_num_seqs)")
        ax.set_ylabel("tokens/s ÷ CB tokens/s (CB not overlapped)")
        ax.set_title("no early exit (mean depth 4.0 of 4)" if t >= 4.0 else f"replayed mean exit depth {t} of 4", fontsize=9)
        ax.legend(fontsize=7); ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(header(doc), fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot_looped_huginn(path):
    """Huginn: speed-up over CB vs width; a panel per mean depth; a line per mode × min coda batch."""
    doc = json.loads(path.read_text())
    rows = doc["results"]
    depths = sorted({r["target_mean_depth"] for r in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(max(5.2 * len(depths), 8.5), 4.3), squeeze=False)
    # A line per (mode, min coda relative to W, reserve or not).
    colors = {("cdb-no-refill", "1"): "tab:cyan", ("cdb-no-refill", "W/4"): "tab:blue", ("cdb-refill", "1"): "tab:orange",
              ("cdb-refill", "W/4"): "tab:red", ("cdb-refill", "W/2"): "tab:purple", ("cdb-refill", "W"): "tab:green"}
    for ax, t in zip(axes[0], depths):
        at = [r for r in rows if r["target_mean_depth"] == t and r["mode"] != "cb"]
        keys = sorted({(r["mode"], coda_relative(r), r.get("coda_reserve", 0) > 0) for r in at}, key=lambda k: (k[0], k[2], k[1]))
        for mode, rel, reserved in keys:
            pts = sorted((r for r in at if (r["mode"], coda_relative(r), r.get("coda_reserve", 0) > 0) == (mode, rel, reserved)), key=lambda r: r["width"])
            ov = " + overlap" if pts[0].get("overlap") else ""
            res = f", reserve {'W − 1' if rel == 'W' else rel + ' − 1'}" if reserved else ""
            st = ("s" if "no-refill" in mode else "o") + ("-" if reserved else "--")
            ax.plot([r["width"] for r in pts], [r["speedup_vs_cb"] for r in pts], st, color=colors.get((mode, rel), "tab:gray"),
                    label=f"{mode}{ov}, min coda {rel}{res}")
        bw = sorted({r["width"] for r in at})
        ax.plot(bw, [max(r["flop_bound"] for r in at if r["width"] == w) for w in bw], "k--", lw=1.2, label="FLOP bound")
        adj = prefill_adjusted(rows, at)
        if adj:
            ax.plot([w for w, _ in adj], [x for _, x in adj], "k:", lw=1.2, label="prefill-adjusted bound")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(bw)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(0.9, None)
        ax.set_xlabel("width W (max_num_seqs)")
        ax.set_ylabel("tokens/s ÷ CB tokens/s (CB not overlapped)")
        ax.set_title(f"replayed mean exit depth {t:g} of 16 (min 2), F0/Fr = {doc['f0_over_fr']:.3f}", fontsize=9)
        ax.legend(fontsize=7, loc="lower left"); ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(header(doc), fontsize=9)
    fig.tight_layout()
    save(fig, path)


# FOCUS README figure (sands-lab/FOCUS assets/Efficiency.svg), SDAR-8B-Chat-b32 on ShareGPT, GPU not
# stated: LMDeploy baseline (threshold 0.9, no delayed cache) and FOCUS (spec/diffusion-lms-and-focus.md §2.2).
LMDEPLOY_SDAR = {32: 838, 64: 913, 128: 938, 256: 979}
FOCUS_SDAR = {32: 1218, 64: 1850, 128: 2160, 256: 2272}
DIFFUSION_TARGET = 2500
# Commits whose K/V write was candle's scatter_set (the CUDA kv_write kernel landed in 256afb9).
SCATTER_KV_WRITE = {"0b3e183", "b3c36cf", "11bbbf5"}


def plot_diffusion(path):
    """Left: generated tokens/s by batch per mode (window solid, whole run dashed) against the
    references. Right: one full-batch step split by phase (share of the step, total ms on top)."""
    doc = json.loads(path.read_text())
    rows = doc["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.4), gridspec_kw={"width_ratios": [1.15, 1]})
    colors = {"baseline": "tab:blue", "baseline-delayed": "tab:red", "focus": "tab:purple"}
    for mode in sorted({r["mode"] for r in rows}):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        b = [r["batch"] for r in pts]
        c = colors.get(mode)
        ax.plot(b, [r["tokens_per_s"] for r in pts], "o-", color=c, label=f"ponder {mode} (window)")
        ax.plot(b, [r["tokens_per_s_whole_run"] for r in pts], "o--", color=c, alpha=0.45, ms=4, label=f"ponder {mode} (whole run)")
    ax.plot(list(LMDEPLOY_SDAR), list(LMDEPLOY_SDAR.values()), "s:", color="tab:gray", label="LMDeploy baseline (FOCUS README, GPU n/s)")
    ax.plot(list(FOCUS_SDAR), list(FOCUS_SDAR.values()), "^:", color="tab:green", label="LMDeploy + FOCUS (FOCUS README, GPU n/s)")
    ax.axhline(DIFFUSION_TARGET, color="k", ls="--", lw=1, label=f"target {DIFFUSION_TARGET:,} tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylim(0, max(DIFFUSION_TARGET * 1.6, 1.15 * max(r["tokens_per_s"] for r in rows)))
    ax.set_xlabel("batch B (max_num_seqs)"); ax.set_ylabel("generated tokens/s")
    dps = [r["decoded_per_step"] for r in rows]
    ax.set_title(f"block 32, replayed unmask mean {rows[0]['mean_unmask']:g} "
                 f"(realised {min(dps):.2f}–{max(dps):.2f} per step)", fontsize=9)
    ax.legend(fontsize=6.5, loc="lower right", ncol=2, framealpha=0.95); ax.grid(True, which="both", alpha=0.3)
    bd = sorted(doc.get("breakdown") or [], key=lambda r: r["batch"])
    write = "K/V write (candle scatter_set)" if str(doc.get("commit"))[:7] in SCATTER_KV_WRITE else "K/V write"
    if bd and "qkv_norm_rope_kv_write_ms" in bd[0]:  # fused projection (e18a0d2 on)
        phases = [("o_proj_mlp_ms", "o_proj + MLP", "tab:blue"), ("lm_head_readout_ms", "LM head + greedy readout", "tab:orange"),
                  ("qkv_norm_rope_kv_write_ms", "QKV + q/k norm + RoPE + K/V write", "tab:cyan")]
    else:
        phases = [("kv_write_ms", write, "tab:red"), ("o_proj_mlp_ms", "o_proj + MLP", "tab:blue"),
                  ("lm_head_readout_ms", "LM head + readout (f32 logits)", "tab:orange"),
                  ("qkv_norm_rope_ms", "QKV + q/k norm + RoPE", "tab:cyan")]
    phases += [("attention_ms", "paged attention", "tab:purple"), ("embed_rope_ms", "embed + RoPE angles", "tab:gray")]
    x = list(range(len(bd)))
    bottom = [0.0] * len(bd)
    for key, label, c in phases:
        share = [100 * r[key] / r["total_ms"] for r in bd]
        bx.bar(x, share, bottom=bottom, color=c, label=label, width=0.6)
        bottom = [b + s for b, s in zip(bottom, share)]
    for i, r in enumerate(bd):
        bx.text(i, 101, f"{r['total_ms']:.0f} ms", ha="center", va="bottom", fontsize=8)
    bx.set_xticks(x, [f"B={r['batch']}\n{r['tokens']} tok" for r in bd])
    bx.set_ylim(0, 112); bx.set_ylabel("share of one step (%)")
    bx.set_title(f"one full-batch step by phase (whole blocks, prefix {bd[0]['prefix'] if bd else ''})", fontsize=9)
    bx.legend(fontsize=7, loc="lower left", framealpha=0.9)
    fig.suptitle(f"{doc['model']} — {doc['gpu']}, commit {doc['commit']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


FOCUS_TARGET = 2.3


DIFFUSION_MODE_COLORS = {"baseline": "tab:blue", "baseline-delayed": "tab:red", "focus": "tab:purple"}


def by_batch(rows, mode):
    return sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])


def batch_axis(ax, batches):
    ax.set_xscale("log", base=2); ax.set_xticks(batches)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())


def plot_modes_and_focus_ratios(ax, bx, rows, baseline_ratio_label):
    """Left axis: tokens/s by batch per diffusion mode. Right axis: FOCUS ÷ each baseline."""
    for mode, c in DIFFUSION_MODE_COLORS.items():
        pts = by_batch(rows, mode)
        ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", color=c, label=f"ponder {mode}")
    fo = by_batch(rows, "focus")
    bx.plot([r["batch"] for r in fo], [r["speedup_vs_baseline"] for r in fo], "o-", color="tab:blue", label=baseline_ratio_label)
    bx.plot([r["batch"] for r in fo], [r["speedup_vs_delayed"] for r in fo], "o-", color="tab:red", label="FOCUS ÷ baseline-delayed")


def plot_focus(path):
    """Left: tokens/s by batch (baseline, delayed cache, FOCUS) with the FOCUS README figures.
    Right: FOCUS's speed-up over both baselines against the 2.3× target."""
    doc = json.loads(path.read_text())
    rows = doc["results"] + doc.get("baseline_delayed", [])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.2))
    batches = sorted({r["batch"] for r in rows})
    plot_modes_and_focus_ratios(ax, bx, rows, "FOCUS ÷ baseline (no delayed cache)")
    ax.plot(list(LMDEPLOY_SDAR), list(LMDEPLOY_SDAR.values()), "s:", color="tab:gray", label="LMDeploy baseline (FOCUS README)")
    ax.plot(list(FOCUS_SDAR), list(FOCUS_SDAR.values()), "^:", color="tab:green", label="LMDeploy + FOCUS (FOCUS README)")
    batch_axis(ax, batches)
    ax.set_ylim(0, None); ax.set_xlabel("batch B"); ax.set_ylabel("generated tokens/s")
    ax.set_title("same replayed unmask counts for every mode (like-for-like)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left"); ax.grid(True, which="both", alpha=0.3)
    paper = {b: FOCUS_SDAR[b] / LMDEPLOY_SDAR[b] for b in FOCUS_SDAR}
    bx.plot(list(paper), list(paper.values()), "^:", color="tab:green", label="FOCUS README (τ 0.8 vs 0.9, not like-for-like)")
    bx.axhline(FOCUS_TARGET, color="k", ls="--", lw=1, label=f"target {FOCUS_TARGET}× at B = 256")
    bx.axhline(1.0, color="gray", lw=0.8)
    batch_axis(bx, batches)
    bx.set_ylim(0, 2.8); bx.set_xlabel("batch B"); bx.set_ylabel("speed-up (tokens/s ratio)")
    bx.legend(fontsize=7, loc="lower right"); bx.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"FOCUS (α 1.5), {doc['model']} — {doc['gpu']}, commit {doc['commit']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot_llada2(path):
    """LLaDA2.0-mini. Left: tokens/s by batch per mode with the baseline's compute bound. Right:
    FOCUS's speed-up over both baselines (criteria: > 1 over the delayed cache at every batch,
    >= 1.5 over the baseline at 256) and the baseline's fraction of its compute bound."""
    doc = json.loads(path.read_text())
    rows = doc["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.2))
    batches = sorted({r["batch"] for r in rows})
    plot_modes_and_focus_ratios(ax, bx, rows, "FOCUS ÷ baseline")
    base = by_batch(rows, "baseline")
    ax.plot([r["batch"] for r in base], [r["compute_bound_tokens_per_s"] for r in base], "k--", label="baseline's compute bound")
    batch_axis(ax, batches)
    ax.set_yscale("log")
    ax.set_xlabel("batch B"); ax.set_ylabel("generated tokens/s")
    ax.legend(fontsize=7, loc="upper left"); ax.grid(True, which="both", alpha=0.3)
    bx.plot([r["batch"] for r in base], [2 * r["fraction_of_compute_bound"] for r in base], "s:", color="k", label="baseline's fraction of its bound × 2 (1 = 50 %)")
    bx.axhline(1.0, color="gray", lw=0.8); bx.axhline(1.5, color="tab:blue", ls="--", lw=0.8)
    batch_axis(bx, batches)
    bx.set_ylim(0, 2.2); bx.set_xlabel("batch B"); bx.set_ylabel("ratio")
    bx.legend(fontsize=7, loc="lower right"); bx.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{doc['model']} — {doc['gpu']}, commit {doc['commit']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot_looped_roofline(path):
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels, values, colors = [], [], []
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, wl in enumerate(workloads):
        for r in (r for r in rows if r["workload"] == wl):
            labels.append(f"{wl}\nW {r['width']}")
            values.append(100 * r["fraction"])
            colors.append(palette[i % len(palette)])
    x = range(len(values))
    ax.bar(x, values, color=colors)
    for xi, v in zip(x, values):
        ax.text(xi, v + 1, f"{v:.0f}", ha="center", fontsize=7)
    ax.axhline(75, color="k", ls="--", lw=1, label="target 75 % (CB)")
    ax.axhline(70, color="k", ls=":", lw=1, label="target 70 % (depth batching, decode side)")
    ax.axhline(65, color="grey", ls="-.", lw=1, label="milestone 65 % (CB)")
    ax.set_xticks(list(x)); ax.set_xticklabels(labels, fontsize=5.5, rotation=90)
    ax.set_ylabel("% of the roofline (prefill: of the matmul peak)"); ax.set_ylim(0, 118)
    ax.legend(fontsize=6.5, loc="upper left", ncol=3); ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"Looped models against the memory/compute roofline — {doc['gpu']}, commit {doc['commit']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def plot(path):
    stem = path.stem
    if stem.startswith("looped_roofline"):
        plot_looped_roofline(path)
    elif stem.startswith("looped_cb"):
        plot_looped_cb(path)
    elif stem.startswith("looped_huginn"):
        plot_looped_huginn(path)
    elif stem.startswith("looped_cdb"):
        plot_looped_cdb(path)
    elif stem.startswith("quality"):
        import plot_quality  # tools/plot_quality.py: the tiny-Ouro and tiny-SDAR quality reports
        plot_quality.plot(path)
    elif stem.startswith("diffusion"):
        plot_diffusion(path)
    elif stem.startswith("focus"):
        plot_focus(path)
    elif stem.startswith("llada2"):
        plot_llada2(path)


if __name__ == "__main__":
    names = sys.argv[1:]
    paths = [bench / n for n in names] if names else sorted(bench.glob("*.json"))
    for p in paths:
        plot(p)
