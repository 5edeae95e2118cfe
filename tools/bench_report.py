#!/usr/bin/env python3
"""Writes docs/BENCHMARKS.md and the plots it embeds (docs/bench/*.svg) from docs/bench/*.json.

    python3 tools/bench_report.py              # needs matplotlib, e.g. in a venv:
    python3 -m venv /tmp/mplvenv && /tmp/mplvenv/bin/pip install matplotlib
    /tmp/mplvenv/bin/python tools/bench_report.py
    python3 tools/bench_report.py --no-plots   # the document only (stdlib)

The document is rewritten wholesale: edit this script, not docs/BENCHMARKS.md. Every number in
it is read from a JSON file when this runs; only the prose is fixed text here. The plots are
rewritten too (SVG only): they carry no date and fixed element ids, so a rerun on unchanged data
(same matplotlib) changes nothing. The script checks that every file the document links exists.

A section reads its files by name: to publish a new run, put its JSON in docs/bench/ (the
`--json` output of examples/bench_looped or bench_diffusion, which records GPU, commit and
command) and point the section at it.
"""
import argparse
import importlib.util
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "bench"
DOC = ROOT / "docs" / "BENCHMARKS.md"
matplotlib = plt = None  # imported by make_plots(): the document alone needs only the stdlib
_cache = {}


def load(name):
    if name not in _cache:
        _cache[name] = json.loads((BENCH / name).read_text())
    return _cache[name]


# ---- derived figures ----

def coda_relative(r):
    """Min coda batch relative to the width: "1", "W/4", "W/2", "W" or the number."""
    m, w = r["min_coda_batch_size"], r["width"]
    return {1: "1", max(w // 4, 1): "W/4", max(w // 2, 1): "W/2", w: "W"}.get(m, str(m))


def same_run_cb(rows, r):
    """The CB row of r's width from r's own run (its raw file), else any CB row of that width."""
    cbs = [c for c in rows if c["mode"] == "cb" and c["width"] == r["width"]]
    return next((c for c in cbs if c.get("source") == r.get("source")), cbs[0] if cbs else None)


def generated_tokens(r):
    st = r["stages"]
    return sum(v["rows"] for k, v in st.items() if k in ("prefill", "decode", "coda"))


def prefill_adjusted_bound(cb, flop_bound):
    """The paper's realistic ceiling from a CB row with device spans: CB's device time with its
    decode divided by the FLOP bound and its prefill unchanged (no prompt token exits early).
    None without spans."""
    st = cb.get("stages", {})
    p, d = st.get("prefill", {}).get("device_s"), st.get("decode", {}).get("device_s")
    if p is None or d is None:
        return None
    return (p + d) / (p + d / flop_bound)


# ---- formatting ----

def num(x, d=0):
    return "—" if x is None else f"{x:.{d}f}"


def pct(x, d=1):
    return "—" if x is None else f"{100 * x:.{d}f} %"


def times(x, d=2):
    return "—" if x is None else f"{x:.{d}f}×"


def span(xs, d=1, scale=100, unit=" %"):
    """'lo–hi' with a unit, e.g. '75.0–84.6 %'."""
    lo, hi = f"{scale * min(xs):.{d}f}", f"{scale * max(xs):.{d}f}"
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def source(name, d=None, date=True):
    d = d or load(name)
    when = d.get("date") or d.get("run_date")
    return (f"Data: [`{name}`](bench/{name}) — {d['gpu']}, commit `{d['commit']}`"
            + (f", {when}" if date and when else "") + ".")


def commands(cmds):
    return ["```sh", *cmds, "```"]


def doc_commands(d):
    return d.get("commands") or [d["command"]]


def plot(stem, alt):
    return [f"![{alt}](bench/{stem}.svg)"]


def widths(ws):
    return " / ".join(str(w) for w in ws)


# ---- sections ----

def intro():
    """Written after the other sections: the GPUs are those of every file they read."""
    gpus = sorted({d["gpu"] for n, d in _cache.items() if not n.startswith("h100/")})
    h100 = sorted({d["gpu"] for n, d in _cache.items() if n.startswith("h100/")})
    return [
        "# Benchmarks",
        "",
        "<!-- Written by tools/bench_report.py from docs/bench/*.json: edit the script, not this file. -->",
        "",
        f"Throughput of the looped and diffusion engines on one {' / '.join(gpus)} (its own section: one "
        f"{' / '.join(h100)}), the `gpu` field of each JSON. The models are **random bf16 weights in the released "
        "shapes**, generated on the device, and the model's decisions are **replayed** — exit depths for the looped "
        "models, tokens unmasked per step for diffusion — so every mode compared does the same work. Tokens/s count "
        "generated tokens.",
        "",
        "## How to reproduce",
        "",
        "- Build without a GPU, pack the binaries and run them on the device machine: [`GPU.md`](GPU.md). "
        "In the commands below `.device/X` is the packed `examples/X` built at the commit named "
        "(`.device/new/X` and `.device/old/X`: the two sides of an A/B).",
        "- Every figure is given with the exact command and commit recorded in its JSON (`docs/bench/`, linked "
        "beside each table), which also holds every column the tables leave out.",
        "- This document and its plots: `python3 tools/bench_report.py` (matplotlib).",
        "- Host-side cost of scheduling (CPU only, no device): `cargo bench --bench scheduling` (criterion) times "
        "one CB decode tick and one depth-batching tick — scheduling and KV bookkeeping without a model — at "
        "several widths, the overhead the host adds to each launch. No JSON is recorded, so no figures here.",
        "",
    ]


def roofline():
    name = "looped_roofline.json"
    d = load(name)
    rows = []
    for r in d["rows"]:
        note = ""
        if r.get("speedup_vs_cb"):
            note = f"{times(r['speedup_vs_cb'])} over CB, {pct(r['fraction_of_prefill_adjusted_bound'])} of the prefill-adjusted bound"
        if r.get("prefill_tflops"):
            note = f"{r['prefill_tflops']:.0f} of {r['matmul_peak_tflops']:.0f} TFLOP/s"
        rows.append([r["workload"], r["width"], num(r["decode_tokens_per_s"]), num(r["step_ms"], 2), num(r["roofline_ms"], 2),
                     f"**{pct(r['fraction'])}**", pct(r["target"], 0) if r.get("target") else "—",
                     f"`{r['commit']}`" + (f" ({r['runs']} runs)" if r["runs"] > 1 else ""), note])
    # One line per distinct command; runs that differ only in their --json path are counted.
    seen, groups = set(), {}
    for r in d["rows"]:
        for c in r["commands"]:
            if c not in seen:
                seen.add(c)
                groups.setdefault(re.sub(r"--json \S+", "", c), []).append(c)
    cmds = [g[0] + (f"   # run {len(g)}×" if len(g) > 1 else "") for g in groups.values()]
    return [
        "## CB decode against the memory roofline",
        "",
        f"Full-depth continuous batching (CB) decode on {d['model']}. Each row sets the decode step time against "
        "the roofline max(bytes ÷ copy bandwidth, FLOPs ÷ bf16 matmul peak): the bytes (the weights of the stages "
        "run, each row's K/V at its context) and FLOPs are counted from the launch's own rows, and both ceilings "
        "are measured in the same process. The fraction is how much of the GPU a decode step uses, so what is "
        "left to gain from kernels; the depth-batching rows put its decode side on the same scale, and the last "
        "row is the prompt prefill against the matmul peak.",
        "",
        *table(["workload", "W", "decode tok/s", "step ms", "roofline ms", "of the roofline", "target", "commit", "note"], rows),
        "",
        f"Data: [`{name}`](bench/{name}) — {d['gpu']}; each row names its commit. Commands:",
        *commands(cmds),
        *plot("looped_roofline", "fraction of the roofline by workload and width"),
        "",
    ]


def decode_side(rows, r):
    """CB's decode device time per generated token ÷ depth batching's (core + coda), as a fraction of S."""
    cb = same_run_cb(rows, r)
    dev = lambda x, ks: sum(x["stages"][k]["device_s"] for k in ks if k in x["stages"])
    ratio = (dev(cb, ["decode"]) / generated_tokens(cb)) / (dev(r, ["decode", "core", "coda"]) / generated_tokens(r))
    return ratio / r["flop_bound"]


def cdb():
    name = "looped_cdb_9327f4f.json"
    d = load(name)
    R = d["results"]
    cb = {r["width"]: r for r in R if r["mode"] == "cb"}
    refill = sorted((r for r in R if r["mode"] == "cdb-refill" and r["overlap"]), key=lambda r: r["width"])
    head = [[r["width"], num(cb[r["width"]]["tokens_per_s"]), num(r["tokens_per_s"]), num(r["mean_depth"], 2),
             f"**{times(r['speedup_vs_cb'])}**", times(r["flop_bound"]), f"**{pct(r['fraction_of_bound'])}**",
             pct(decode_side(R, r)), pct(r["fraction_of_prefill_adjusted_bound"]),
             f"{pct(cb[r['width']]['gpu_idle'])} / {pct(r['gpu_idle'])}"] for r in refill]

    gname = "looped_cdb.json"
    g = load(gname)
    G = g["results"]
    pick = lambda w, mode, t: next(r for r in G if r["width"] == w and r["mode"] == mode and r["target_mean_depth"] == t)
    gw = sorted({r["width"] for r in G})
    cell = lambda r: f"{times(r['speedup_vs_cb'])} ({pct(r['fraction_of_bound'])})"
    lo, hi = sorted({r["target_mean_depth"] for r in G})  # the headline's depth and a deeper one
    grid = [[w, num(pick(w, "cb", lo)["tokens_per_s"]), cell(pick(w, "cdb-no-refill", lo)), cell(pick(w, "cdb-refill", lo)),
             cell(pick(w, "cdb-refill", hi))] for w in gw]
    slower = [1 - pick(w, "cb", lo)["tokens_per_s"] / cb[w]["tokens_per_s"] for w in gw if w in cb]

    oname = "looped_cdb_2026-11-29a.json"
    o = load(oname)
    O = o["results"]
    noexit = {r["target_mean_depth"] for r in O if r["flop_bound"] == 1.0}
    find = lambda w, t, ov: next((r for r in O if r["width"] == w and r["mode"] == "cdb-refill" and bool(r["overlap"]) == ov
                                  and r["target_mean_depth"] == t), None)
    ow = sorted({r["width"] for r in O if r["mode"] == "cdb-refill" and not r["overlap"] and r["target_mean_depth"] not in noexit})
    t0 = min(r["target_mean_depth"] for r in O)
    tn = max(noexit)
    f = lambda r, k: "—" if r is None else (pct(r[k]) if k == "fraction_of_bound" else times(r[k], 3))
    over = [[w, f(find(w, t0, False), "fraction_of_bound"), f(find(w, t0, True), "fraction_of_bound"),
             f(find(w, tn, False), "speedup_vs_cb"), f(find(w, tn, True), "speedup_vs_cb")] for w in ow]
    return [
        "## Continuous depth batching against CB",
        "",
        f"{d['model']}. Continuous depth batching (CDB) lets each token leave the loop at its own exit depth — "
        "replayed here from a distribution with the target mean d̄ — and refills the rows exits free in the next "
        "core launch (*refill*), with the host preparing launch N + 1 while the device runs N (*overlap*). Both "
        "modes serve the same requests (ShareGPT-like lognormal prompt and output lengths, all queued at the "
        "start). The FLOP bound S is CB's FLOPs ÷ depth batching's at the realised depths, the most early exit "
        "can give; the *prefill-adjusted* bound divides only CB's decode device time by S, since no prompt token "
        "exits early. The fraction of S is how much of the work early exit removes the scheduler turns into "
        "throughput; the *decode side* compares only CB's decode device time per generated token with depth "
        "batching's core and coda launches (stream-event spans, `--time-device`).",
        "",
        *table(["W", "CB tok/s", "CDB refill + overlap tok/s", "d̄", "× over CB", "S", "of S", "decode side, of S",
                "of the prefill-adjusted bound", "GPU idle CB / CDB"], head),
        "",
        source(name),
        *commands(doc_commands(d)),
        *plot("looped_cdb_9327f4f", "CDB speed-up over CB by width"),
        "",
        "**Without refill, and at a deeper mean exit.** *No-refill* runs lock-step waves (a launch holds only the "
        "tokens that have not exited, so it shrinks until the wave ends). Cells: × over CB (of S). This run's CB "
        f"admits a prefill whenever one slot frees, {span(slower)} slower than the CB above, which batches its "
        "prefill like the depth scheduler; these ratios flatter depth batching by that much.",
        "",
        *table(["W", "CB tok/s", f"no-refill + overlap, d̄ {lo:g}", f"refill + overlap, d̄ {lo:g}", f"refill + overlap, d̄ {hi:g}"], grid),
        "",
        source(gname),
        *commands(doc_commands(g)),
        *plot("looped_cdb", "no-refill and refill at two mean depths"),
        "",
        f"**What overlap alone is worth.** Refill with the host waiting for each launch (*sync*) against refill "
        f"with overlap, at d̄ {t0:g} and with no early exit (d̄ {tn:g}, S = 1, where only overlap can gain). GPU "
        "idle in this run was measured by an older host-side method and is left out.",
        "",
        *table(["W", f"sync, d̄ {t0:g}: of S", f"overlap, d̄ {t0:g}: of S", "sync, no exit: × over CB",
                "overlap, no exit: × over CB"], over),
        "",
        source(oname),
        *commands(doc_commands(o)),
        *plot("looped_cdb_2026-11-29a", "overlap on and off, with and without early exit"),
        "",
    ]


def huginn():
    name = "looped_huginn.json"
    d = load(name)
    R = d["results"]
    cdbr = [r for r in R if r["mode"] == "cdb-refill"]
    assert all(r["min_coda_batch_size"] == r["width"] and r["coda_reserve"] == r["width"] - 1 for r in cdbr)
    depths = sorted({r["target_mean_depth"] for r in cdbr}, reverse=True)
    rows = []
    for wd in sorted({r["width"] for r in cdbr}):
        at = [next(r for r in cdbr if (r["width"], r["target_mean_depth"]) == (wd, t)) for t in depths]
        cbs = list(dict.fromkeys(num(same_run_cb(R, r)["tokens_per_s"]) for r in at))
        rows.append([wd, " / ".join(cbs), *[c for r in at for c in (num(r["tokens_per_s"]), f"**{times(r['speedup_vs_cb'])}**",
                     f"**{pct(r['fraction_of_bound'])}**", pct(r["fraction_of_prefill_adjusted_bound"]))],
                     " / ".join(dict.fromkeys(f"`{r['commit']}`" for r in at))])
    dhead = []
    for t in depths:
        S = [r["flop_bound"] for r in cdbr if r["target_mean_depth"] == t]
        dhead += [f"d̄ {t:g} (S {span(S, 2, 1, '×')}): CDB tok/s", "× over CB", "of S", "of the prefill-adjusted bound"]
    w = d["workload"]

    sname = "looped_huginn_short.json"
    s = load(sname)
    S = s["results"]
    configs = [("W/4", False, "coda W/4, no reserve (the paper's)"), ("W/2", True, "coda W/2, reserve"), ("W", True, "coda W, reserve")]
    keys = sorted({(r["width"], r["target_mean_depth"]) for r in S}, key=lambda k: (-k[1], k[0]))
    srows = []
    for wd, t in keys:
        at = [r for r in S if (r["width"], r["target_mean_depth"]) == (wd, t)]
        cells = []
        for rel, res, _ in configs:
            r = next((r for r in at if r["mode"] == "cdb-refill" and coda_relative(r) == rel and (r["coda_reserve"] > 0) == res), None)
            cells.append("—" if r is None else f"{times(r['speedup_vs_cb'])} ({pct(r['fraction_of_bound'])})")
        srows.append([wd, f"{t:g}", num(next(r for r in at if r["mode"] == "cb")["tokens_per_s"]), *cells])
    return [
        "## Huginn-0125: depth batching on a deep recurrence",
        "",
        f"{d['model']}: with a deep recurrence, early exit removes most of a token's work, so this is where depth "
        "batching gains most. CB against depth batching with refill and overlap; every token's depth is replayed "
        "with the target mean d̄ above a minimum depth (`--mean-depths`, `--min-depth`). Huginn's coda (the head and the "
        "re-entry prelude) waits until W exited tokens are ready, and a reserve of W − 1 extra resident requests "
        "keeps the core launches full meanwhile. Decode-heavy workload: prompts lognormal with median "
        f"{w['prompt']['median']:g} (≤ {w['prompt']['max']}), outputs median {w['output']['median']:g} "
        f"(≤ {w['output']['max']}) tokens.",
        "",
        *table(["W", "CB tok/s", *dhead, "commit"], rows),
        "",
        f"Data: [`{name}`](bench/{name}) — {d['gpu']}, commits `{d['commit']}`, {d['date']}. Commands:",
        *commands(doc_commands(d)),
        *plot("looped_huginn", "Huginn: speed-up over CB by width"),
        "",
        "**Short outputs, and how long to hold the coda.** The default ShareGPT-like lengths; three coda settings "
        "at each width, from the CDB paper's (coda held for W/4 exited tokens, no reserve) to a full-width coda "
        "with a reserve of one less than the coda. Cells: × over CB (of S).",
        "",
        *table(["W", "target d̄", "CB tok/s", *[c[2] for c in configs]], srows),
        "",
        f"Data: [`{sname}`](bench/{sname}) — {s['gpu']}, commits `{s['commit']}`, {s['date']}. Commands:",
        *commands(doc_commands(s)),
        *plot("looped_huginn_short", "Huginn short outputs: coda settings"),
        "",
    ]


def long_prompts():
    name = "long_prompts.json"
    d = load(name)
    R = d["results"]
    r0 = R[0]
    rows = []
    for r in R:
        ttft = r["long_ttft_s"]
        label = f"{r['budget']} (chunked)" if r["budget"] != "unchunked" else f"unchunked (budget {r['max_num_batched_tokens']})"
        rows.append([label, f"**{num(r['short_decode_tokens_per_s'])}**",
                     f"{num(r['short_gap_p50_ms'])} / {num(r['short_gap_p99_ms'])} / **{num(r['short_max_gap_ms'])}**",
                     f"{sum(ttft) / len(ttft):.2f} / {max(ttft):.2f}", r["prefill_launches"],
                     f"{r['prefill_s']:.2f} + {r['decode_s']:.2f} = {r['prefill_s'] + r['decode_s']:.2f}"])
    lp = r0["long_prompts"]
    return [
        "## Long prompts among short requests: chunked prefill",
        "",
        f"{d['model']}, CB at W {r0['width']}: {r0['short_requests']} short requests ({r0['short_prompt_len']}-token "
        f"prompts, {r0['short_new_tokens']} new tokens) decode while {len(lp)} long prompts of {min(lp)}–{max(lp)} "
        f"tokens arrive {r0['arrival_gap_ms']} ms apart. The budget (`max_num_batched_tokens`) caps each prefill "
        "launch, and a decode launch runs after every chunk. It measures the latency trade: how fast, and how "
        "evenly, the short requests keep decoding while long prompts prefill, against the long prompts' time "
        "to first token (TTFT) and the total engine time.",
        "",
        *table(["budget", "short decode tok/s", "short token gap p50 / p99 / max, ms", "long TTFT mean / max, s",
                "prefill launches", "engine time, prefill + decode, s"], rows),
        "",
        source(name),
        *commands(doc_commands(d)),
        *plot("long_prompts", "long prompts: short decode rate, longest gap, TTFT by budget"),
        "",
    ]


def sdar():
    dname, fname = "diffusion.json", "focus.json"
    d, f = load(dname), load(fname)
    by = {(r["batch"], r["mode"]): r for r in d["results"] + f["results"]}
    rows = []
    for b in sorted({r["batch"] for r in d["results"]}):
        base, dl, fo = by[(b, "baseline")], by[(b, "baseline-delayed")], by[(b, "focus")]
        rows.append([b, num(base["tokens_per_s"]), num(dl["tokens_per_s"]), f"**{num(fo['tokens_per_s'])}**",
                     times(dl["tokens_per_s"] / base["tokens_per_s"]), f"**{times(fo['speedup_vs_baseline'])}**",
                     times(fo["speedup_vs_delayed"]), f"{dl['tokens_per_step']:.1f} / {fo['kept_per_step']:.1f}",
                     f"{base['decoded_per_step']:.2f} / {fo['decoded_per_step']:.2f}"])
    bd = sorted(d["breakdown"], key=lambda r: r["batch"])
    phases = [("o_proj_mlp_ms", "o_proj + MLP"), ("qkv_norm_rope_kv_write_ms", "QKV + norms + RoPE + K/V write"),
              ("attention_ms", "attention"), ("lm_head_readout_ms", "LM head + readout")]
    brows = [[r["batch"], r["tokens"], f"**{r['total_ms']:.1f}**", *[f"{r[k]:.1f} ({100 * r[k] / r['total_ms']:.0f} %)" for k, _ in phases]]
             for r in bd]
    return [
        "## SDAR-8B: block diffusion, delayed cache and FOCUS",
        "",
        f"{d['model']}, served by the public engine. Each step runs a request's current block through the model "
        "and reveals the replayed number of tokens, the same counts in every mode (realised per request-step in "
        "the last column). *Baseline* recomputes the whole block every step; the *delayed cache* keeps a revealed "
        "token's K/V once its right neighbour is revealed too; *FOCUS* (on the delayed cache) scores the block's "
        "tokens in layers 0–1 and runs the rest of the model only on those it keeps. What it shows: how much work the "
        f"cache and the eviction take off a step at each batch size. Workload: {d['workload']}.",
        "",
        *table(["B", "baseline tok/s", "delayed tok/s", "FOCUS tok/s", "delayed ÷ baseline", "FOCUS ÷ baseline",
                "FOCUS ÷ delayed", "positions per request-step: delayed / FOCUS past layer 1", "decoded per request-step: baseline / FOCUS"], rows),
        "",
        "Where one full-batch step goes (synthetic step of whole blocks after a prompt, `--breakdown`), ms (share):",
        "",
        *table(["B", "tokens", "step ms", *[p for _, p in phases]], brows),
        "",
        source(dname) + f" FOCUS rows: [`{fname}`](bench/{fname}), the same run.",
        *commands(doc_commands(d)),
        plot("diffusion", "SDAR-8B: tokens/s by batch and the phases of a step")[0] + " "
        + plot("focus", "FOCUS against both baselines")[0],
        "",
    ]


def llada2():
    name, cname = "llada2.json", "llada2_3299c4f.json"
    d, c = load(name), load(cname)
    by = {(r["batch"], r["mode"]): r for r in d["results"]}
    rows = []
    for b in sorted({r["batch"] for r in d["results"]}):
        base, dl, fo = by[(b, "baseline")], by[(b, "baseline-delayed")], by[(b, "focus")]
        rows.append([b, f"{num(base['tokens_per_s'])} ({pct(base['fraction_of_compute_bound'])})",
                     f"{num(dl['tokens_per_s'])} ({pct(dl['fraction_of_compute_bound'])})", f"**{num(fo['tokens_per_s'])}**",
                     f"**{times(fo['speedup_vs_baseline'])}**", f"**{times(fo['speedup_vs_delayed'], 3)}**",
                     f"{fo['tokens_per_step']:.1f} → {fo['kept_per_step']:.1f}", f"{max(r['peak_device_memory_gb'] for r in (base, dl, fo)):.1f}"])
    cby = {(r["batch"], r["mode"]): r for r in c["results"]}
    cb_ = sorted({r["batch"] for r in c["results"]})
    top = cb_[-1]
    return [
        "## LLaDA2.0-mini (MoE): delayed cache and FOCUS",
        "",
        f"{d['model']}: the same three modes as SDAR on a mixture-of-experts model, where a step also streams the "
        "experts its tokens route to. The compute bound is the tokens/s the step's matmul FLOPs would allow at the "
        f"bf16 matmul peak measured in the same run ({d['results'][0]['matmul_peak_tflops']:.0f} TFLOP/s); FOCUS "
        f"with α {d['focus']['alpha']:g} and a knee of {d['focus']['knee_tokens']} tokens. Workload: {d['workload']}.",
        "",
        *table(["B", "baseline tok/s (of compute bound)", "delayed tok/s (of bound)", "FOCUS tok/s", "FOCUS ÷ baseline",
                "FOCUS ÷ delayed", "FOCUS positions per request-step: layers 0–1 → past 1", "peak device memory, GB"], rows),
        "",
        source(name, date=False),
        *commands(doc_commands(d)),
        "",
        f"Confirmation run, same command at `{c['commit']}` ([`{cname}`](bench/{cname})): baseline at B {top} "
        f"{pct(cby[(top, 'baseline')]['fraction_of_compute_bound'])} of its bound; FOCUS ÷ delayed "
        + " / ".join(times(cby[(b, 'focus')]['speedup_vs_delayed']) for b in cb_) + f" at B {widths(cb_)}; FOCUS ÷ baseline "
        f"{times(cby[(top, 'focus')]['speedup_vs_baseline'])} at B {top}.",
        "",
        *plot("llada2", "LLaDA2.0-mini: tokens/s by batch and FOCUS's ratios"),
        "",
    ]


LLADA_MODES = [("exact", "exact"), ("prefix", "prefix cache"), ("dual", "dual cache")]


def llada_modes():
    name = "llada_modes.json"
    d = load(name)
    by = {(r["batch"], r["mode"]): r for r in d["results"]}
    rows = []
    for b in sorted({r["batch"] for r in d["results"]}):
        ex = by[(b, "exact")]["tokens_per_s"]
        rows.append([b, *[f"{num(by[(b, m)]['tokens_per_s'])}" + ("" if m == "exact" else f" (**{times(by[(b, m)]['tokens_per_s'] / ex)}**)")
                          for m, _ in LLADA_MODES],
                     " / ".join(f"{by[(b, m)]['tokens_per_step']:.1f}" for m, _ in LLADA_MODES),
                     " / ".join(f"{by[(b, m)]['launch_ms']:.1f}" for m, _ in LLADA_MODES),
                     f"{by[(b, 'exact')]['peak_device_memory_gb']:.1f}"])
    r0 = d["results"][0]
    return [
        "## LLaDA-8B: exact decoding against prefix and dual cache",
        "",
        f"{d['model']}. LLaDA is decoded as its reference decodes it: every step runs the whole canvas (prompt and "
        "every generated position). Fast-dLLM's *prefix cache* (later steps of a block run the block and the masked "
        "suffix) and *dual cache* (the block only) are opt-in approximations; this is what exactness costs. "
        f"{r0['new_tokens']} new tokens in blocks of {r0['block']}, the same replayed unmask counts in every mode. "
        f"Workload: {d['workload']}.",
        "",
        *table(["B", *[f"{label} tok/s" + ("" if m == "exact" else " (÷ exact)") for m, label in LLADA_MODES],
                "positions per request-step: exact / prefix / dual", "launch ms", "peak device memory, GB"], rows),
        "",
        source(name, date=False),
        *commands(doc_commands(d)),
        *plot("llada_modes", "LLaDA-8B: tokens/s of exact, prefix and dual cache"),
        "",
    ]


GATE_FILES = ["gate_overlap_q0.2_w16_64_9f27546.json", "gate_overlap_q0.2_w256_9f27546.json",
              "gate_overlap_q0.5_w16_64_3ed16d2.json", "gate_overlap_q0.5_w256_3ed16d2.json"]
GATE_SOURCES = [("stock-sync", "(a) stock gate, synchronous"), ("delayed", "(b) stock gate delayed, overlap"),
                ("learned", "(c) learned lookahead, overlap")]


def gate_rows(name):
    d = load(name)
    q = re.search(r"/q([0-9.]+)/", d["command"]).group(1)
    for w in sorted({r["width"] for r in d["results"]}):
        at = {r["depth_source"]: r for r in d["results"] if r["width"] == w and r["mode"] == "cdb-refill"}
        cb = next(r for r in d["results"] if r["width"] == w and r["mode"] == "cb")
        yield q, w, cb, at


def gates():
    rows = []
    for name in GATE_FILES:
        for q, w, cb, at in gate_rows(name):
            a, b, c = (at[s] for s, _ in GATE_SOURCES)
            rows.append([q, w, num(cb["tokens_per_s"]), *[f"{num(x['tokens_per_s'])}, d̄ {x['mean_depth']:.2f}, idle {pct(x['gpu_idle'])}" for x in (a, b, c)],
                         f"**{times(c['tokens_per_s'] / a['tokens_per_s'])}**", times(c["tokens_per_s"] / b["tokens_per_s"])])
    d0 = load(GATE_FILES[0])
    return [
        "## Trained exit gates with overlap",
        "",
        f"{d0['model']}, depth batching with refill on the last-exited K/V layout, replaying the per-token depths "
        "each gate chose on the tiny trained Ouro's held-out text (`docs/bench/gate_traces/`, recorded by "
        "`examples/quality_gates.rs --traces` at the exit thresholds q below). Overlap needs the exit decision one step "
        "early: the stock gate delayed by a step runs deeper, the learned lookahead head decides ahead without "
        "the extra step. This measures whether that head turns overlap into throughput.",
        "",
        *table(["q", "W", "CB tok/s", *[s[1] + ": tok/s, d̄, GPU idle" for s in GATE_SOURCES], "(c) ÷ (a)", "(c) ÷ (b)"], rows),
        "",
        "Data (" + d0["gpu"] + "): " + ", ".join(f"[`{n}`](bench/{n}) (`{load(n)['commit']}`)" for n in GATE_FILES) + ". Commands:",
        *commands([load(n)["command"] for n in GATE_FILES]),
        *plot("gate_overlap", "trained gates with overlap: tokens/s per width"),
        "",
    ]


# ---- H100 ----

H100_FILES = ["looped_cb_622b501.json", "looped_cb_w224_256_622b501.json", "looped_cb_w256_new128_622b501.json",
              "looped_cdb_622b501.json", "diffusion_sdar_622b501.json", "diffusion_llada2_mini_43afb79.json"]


def h200_cb(doc, w):
    """The H200 CB row of the same workload and width in looped_roofline.json, or None."""
    for r in load("looped_roofline.json")["rows"]:
        m = re.match(r"CB, prompt (\d+) \+ (\d+) new", r["workload"])
        if m and (int(m[1]), int(m[2]), r["width"]) == (doc["prompt_len"], doc["new_tokens"], w):
            return r["decode_tokens_per_s"], "looped_roofline.json", r["commit"]
    return None


def h200_cdb(r):
    d = load("looped_cdb_9327f4f.json")
    m = next((x for x in d["results"] if (x["width"], x["mode"], x["overlap"], x["target_mean_depth"])
              == (r["width"], r["mode"], r["overlap"], r["target_mean_depth"])), None)
    return m and (m["tokens_per_s"], "looped_cdb_9327f4f.json", d["commit"])


def h200_diffusion(doc, r):
    """Same model, mode, batch and FOCUS settings (a missing `focus` field is α 1.5, no knee)."""
    cands = (["diffusion.json", "focus.json"] if doc["model"].startswith("SDAR") else
             ["llada2.json"] if doc["model"].startswith("LLaDA2") else [])
    for n in cands:
        d = load(n)
        if r["mode"] == "focus" and d.get("focus", {"alpha": 1.5, "knee_tokens": 0}) != doc["focus"]:
            continue
        for x in d["results"] + d.get("baseline_delayed", []):
            if (x["batch"], x["mode"]) == (r["batch"], r["mode"]):
                return x["tokens_per_s"], n, d["commit"]
    return None


def h100_pairs():
    """(file index, label, H100 tok/s, H200 match) for every H100 figure (match None without an H200 figure)."""
    out = []
    for i, n in enumerate(H100_FILES):
        d = load("h100/" + n)
        for r in d["results"]:
            if "refused" in r:
                continue
            if d.get("suite") == "cb":
                out.append((i, f"cb suite: CB W {r['width']}", r["tokens_per_s"], h200_cb(d, r["width"])))
            elif d.get("suite") == "cdb":
                out.append((i, f"cdb suite: {'CB' if r['mode'] == 'cb' else 'CDB'} W {r['width']}", r["tokens_per_s"], h200_cdb(r)))
            else:
                model = d["model"].split()[0].split("-")[0]
                out.append((i, f"{model} {r['mode'].replace('baseline-', '')} B {r['batch']}", r["tokens_per_s"], h200_diffusion(d, r)))
    return out


def ratio(h100, match):
    return "—" if match is None else times(h100 / match[0])


def h100():
    out = []
    refs = set()
    docs = [load("h100/" + n) for n in H100_FILES]
    kernels = sorted({d["kernels"] for d in docs})
    for n, d in zip(H100_FILES, docs):
        R = d["results"]
        if d.get("suite") == "cb":
            rows = []
            for r in R:
                if "refused" in r:
                    rows.append([r["width"], f"**refused** at build: “{r['refused']}”", "—", "—", "—", "—"])
                    continue
                m = h200_cb(d, r["width"])
                refs |= {m[1:]} if m else set()
                rows.append([r["width"], num(r["tokens_per_s"]), num(r["decode_step_ms"], 2), pct(r["fraction_of_roofline"]),
                             num(r["peak_device_memory_gb"], 1), ratio(r["tokens_per_s"], m)])
            head = ["W", "decode tok/s", "step ms", "of the roofline", "peak device memory, GB", "H100 ÷ H200"]
            what = f"CB, prompt {d['prompt_len']} + {d['new_tokens']} new"
        elif d.get("suite") == "cdb":
            cb = {r["width"]: r for r in R if r["mode"] == "cb"}
            rows = []
            for r in sorted((r for r in R if r["mode"] != "cb"), key=lambda r: r["width"]):
                c = cb[r["width"]]
                mc, mr = h200_cdb(c), h200_cdb(r)
                refs |= {m[1:] for m in (mc, mr) if m}
                rows.append([r["width"], num(c["tokens_per_s"]), num(r["tokens_per_s"]), times(r["speedup_vs_cb"]), pct(r["fraction_of_bound"]),
                             pct(r["fraction_of_prefill_adjusted_bound"]), num(r["peak_device_memory_gb"], 1),
                             f"{ratio(c['tokens_per_s'], mc)} / {ratio(r['tokens_per_s'], mr)}"])
            head = ["W", "CB tok/s", "CDB refill + overlap tok/s", "× over CB", "of S", "of the prefill-adjusted bound",
                    "peak device memory, GB", "H100 ÷ H200: CB / CDB"]
            what = f"depth batching against CB, d̄ {R[0]['target_mean_depth']:g}"
        else:
            by = {(r["batch"], r["mode"]): r for r in R}
            rows = []
            for b in sorted({r["batch"] for r in R}):
                dl, fo = by[(b, "baseline-delayed")], by[(b, "focus")]
                md, mf = h200_diffusion(d, dl), h200_diffusion(d, fo)
                refs |= {m[1:] for m in (md, mf) if m}
                rows.append([b, num(dl["tokens_per_s"]), num(fo["tokens_per_s"]), times(fo["speedup_vs_delayed"]),
                             num(max(dl["peak_device_memory_gb"], fo["peak_device_memory_gb"]), 1),
                             f"{ratio(dl['tokens_per_s'], md)} / {ratio(fo['tokens_per_s'], mf)}"])
            head = ["B", "delayed tok/s", "FOCUS tok/s", "FOCUS ÷ delayed", "peak device memory, GB", "H100 ÷ H200: delayed / FOCUS"]
            what = f"delayed cache and FOCUS (α {d['focus']['alpha']:g}, knee {d['focus']['knee_tokens']})"
        out += [f"**{d['model']}: {what}** — [`h100/{n}`](bench/h100/{n}), commit `{d['commit']}`: `{d['command']}`", "",
                *table(head, rows), ""]
    gpu = docs[0]["gpu"]
    return [
        f"## {gpu}",
        "",
        f"The same benchmarks on one {gpu} (copy bandwidth measured {docs[0]['copy_bandwidth_gb_s']:.0f} GB/s, against "
        f"{load('looped_cdb_9327f4f.json')['sources'][0]['copy_bandwidth_gb_s']:.0f} on the H200), kernel policy "
        f"`{' / '.join(kernels)}`. Where a run's memory does not fit, the engine refuses the width when it is "
        "built and the benchmark records it and goes on. *H100 ÷ H200* divides by the H200 figure of the same "
        "command and workload in the sections above, where one exists (FOCUS settings included); those H200 "
        "runs are at older commits ("
        + ", ".join(f"[`{f}`](bench/{f}) `{c}`" for f, c in sorted(refs)) + "), so the ratio mixes the card with "
        "later code changes.",
        "",
        *out,
        *plot("h100", "H100 ÷ H200 tokens/s for the figures measured on both"),
        "",
    ]


def did_not_pay():
    sk = load("skinny_gemm_ab.json")
    means = {}
    for run in sk["runs"]:
        for r in run["result"]["results"]:
            means.setdefault((run["variant"], r["width"]), []).append(r["tokens_per_s"])
    ws = sorted({w for _, w in means})
    avg = lambda v, w: sum(means[(v, w)]) / len(means[(v, w)])
    g = load("looped_cdb.json")["results"]
    t = min(r["target_mean_depth"] for r in g)
    nr = [r["fraction_of_bound"] for r in g if r["mode"] == "cdb-no-refill" and r["target_mean_depth"] == t]
    rf = [r["fraction_of_bound"] for r in g if r["mode"] == "cdb-refill" and r["target_mean_depth"] == t]
    S = load("looped_huginn_short.json")["results"]
    paper = [r["fraction_of_bound"] for r in S if r["mode"] == "cdb-refill" and coda_relative(r) == "W/4" and r["coda_reserve"] == 0]
    full = [r["fraction_of_bound"] for r in S if r["mode"] == "cdb-refill" and coda_relative(r) == "W" and r["coda_reserve"] > 0]
    ba = [at["delayed"]["tokens_per_s"] / at["stock-sync"]["tokens_per_s"] for n in GATE_FILES for _, _, _, at in gate_rows(n)]
    l2 = {(r["batch"], r["mode"]): r for r in load("llada2.json")["results"]}
    b0 = min(b for b, _ in l2)
    h = {(r["batch"], r["mode"]): r for r in load("h100/diffusion_llada2_mini_43afb79.json")["results"]}
    return [
        "## What did not pay",
        "",
        f"- **Skinny decode GEMMs of our own instead of cuBLAS** (new ÷ old CB tok/s, A/B in one call, {sk['gpu']}): "
        + " / ".join(times(avg("new", w) / avg("old", w)) for w in ws) + f" at W {widths(ws)}; reverted "
        "([`skinny_gemm_ab.json`](bench/skinny_gemm_ab.json)).",
        f"- **Depth batching without refill**: {span(nr)} of S against {span(rf)} with refill at d̄ {t:g} "
        "([`looped_cdb.json`](bench/looped_cdb.json)).",
        f"- **The CDB paper's Huginn coda** (W/4, no reserve): {span(paper)} of S against {span(full)} with a "
        "full-width coda and reserve ([`looped_huginn_short.json`](bench/looped_huginn_short.json)).",
        f"- **Overlap with the stock gate delayed a step**: {span(ba, 2, 1, '×')} the synchronous stock gate's tok/s "
        "at every q and width — the extra loop step costs more than overlap saves (trained-gate section).",
        f"- **FOCUS on the MoE at B {b0}**: {times(l2[(b0, 'focus')]['speedup_vs_delayed'], 3)} the delayed cache on the H200 "
        f"([`llada2.json`](bench/llada2.json)), {times(h[(b0, 'focus')]['speedup_vs_delayed'], 3)} on the H100 "
        "([`h100/diffusion_llada2_mini_43afb79.json`](bench/h100/diffusion_llada2_mini_43afb79.json)).",
        "",
    ]


def document():
    body = [line for section in (roofline, cdb, huginn, long_prompts, sdar, llada2, llada_modes, gates, h100, did_not_pay)
            for line in section()]
    lines = intro() + body
    # A heading runs straight into its first paragraph: keeps the document within its line budget.
    lines = [x for i, x in enumerate(lines) if not (x == "" and i and lines[i - 1].startswith("## "))]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


# ---- plots (matplotlib; SVG only) ----

SVG_META = {"Date": None}  # no timestamp in the SVG: regenerating unchanged data changes nothing


def save(fig, path):
    fig.savefig(path.with_suffix(".svg"), metadata=SVG_META)
    plt.close(fig)
    print("wrote", path.with_suffix(".svg"))


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
    phases = [("o_proj_mlp_ms", "o_proj + MLP", "tab:blue"), ("lm_head_readout_ms", "LM head + greedy readout", "tab:orange"),
              ("qkv_norm_rope_kv_write_ms", "QKV + q/k norm + RoPE + K/V write", "tab:cyan")]
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


FOCUS_TARGET = 2.3  # FOCUS's speed-up target at B 256 (issue)


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



def make_plots():
    global matplotlib, plt
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "ponder"  # stable element ids in the SVGs
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    for name, fn in [("looped_roofline.json", plot_looped_roofline), ("looped_cdb_9327f4f.json", plot_looped_cdb),
                     ("looped_cdb.json", plot_looped_cdb), ("looped_cdb_2026-11-29a.json", plot_looped_cdb),
                     ("looped_huginn.json", plot_looped_huginn), ("looped_huginn_short.json", plot_looped_huginn),
                     ("diffusion.json", plot_diffusion), ("focus.json", plot_focus), ("llada2.json", plot_llada2)]:
        fn(BENCH / name)

    # Long prompts: per budget, short decode tok/s, the short requests' longest gap, long TTFT.
    d = load("long_prompts.json")
    R = d["results"]
    labels = [f"W={r['width']}\n{r['budget']}" for r in R]
    panels = [("short decode tok/s\nwhile prefilling", [r["short_decode_tokens_per_s"] for r in R]),
              ("short requests' longest\ntoken gap (ms)", [r["short_max_gap_ms"] for r in R]),
              ("long TTFT (s):\nmean (bar), max (dot)", [sum(r["long_ttft_s"]) / len(r["long_ttft_s"]) for r in R])]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(labels, values, color=["#4c72b0" if r["budget"] != "unchunked" else "#999999" for r in R])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}" if v >= 10 else f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    axes[2].plot(labels, [max(r["long_ttft_s"]) for r in R], "o", color="#c44e52")
    fig.suptitle(f"{d['model']} on {d['gpu']} @ {d['commit']}: long prompts {R[0]['long_prompts']} among short requests", fontsize=9)
    fig.tight_layout()
    save(fig, BENCH / "long_prompts")

    # LLaDA-8B cache modes: tokens/s per mode and batch, positions per request-step on the bars.
    d = load("llada_modes.json")
    by = {(r["batch"], r["mode"]): r for r in d["results"]}
    batches = sorted({b for b, _ in by})
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (m, label) in enumerate(LLADA_MODES):
        xs = [j + (i - 1) * 0.27 for j in range(len(batches))]
        bars = ax.bar(xs, [by[(b, m)]["tokens_per_s"] for b in batches], width=0.27, label=label)
        for bar, b in zip(bars, batches):
            ax.annotate(f"{by[(b, m)]['tokens_per_step']:.0f} pos", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(batches)), [f"B {b}" for b in batches])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{d['model']} — {d['gpu']}, commit {d['commit']}\n(label: positions run per request-step)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save(fig, BENCH / "llada_modes")

    # Trained gates with overlap: one panel per file, a bar per depth source and width.
    fig, axes = plt.subplots(1, len(GATE_FILES), figsize=(4.6 * len(GATE_FILES), 3.8), squeeze=False)
    for ax, name in zip(axes[0], GATE_FILES):
        g = load(name)
        rpw = re.search(r"--requests-per-width (\d+)", g["command"]).group(1)
        rows = list(gate_rows(name))
        for i, (src, label) in enumerate(GATE_SOURCES):
            xs = [j + (i - 1) * 0.27 for j in range(len(rows))]
            bars = ax.bar(xs, [at[src]["tokens_per_s"] for _, _, _, at in rows], width=0.27, label=label)
            for bar, (_, _, _, at) in zip(bars, rows):
                ax.annotate(f"d̄ {at[src]['mean_depth']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(rows)), [f"W {w}" for _, w, _, _ in rows])
        ax.set_title(f"q = {rows[0][0]}, {rpw} requests per width ({g['commit']})", fontsize=9)
        ax.set_ylabel(f"tokens/s ({g['model'].split(',')[0]}, {g['gpu']})", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save(fig, BENCH / "gate_overlap")

    # H100 against H200 where both ran the same command.
    pairs = [p for p in h100_pairs() if p[3]]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(pairs)), [h / m[0] for _, _, h, m in pairs], color=[palette[i % len(palette)] for i, _, _, _ in pairs])
    for x, (_, _, h, m) in enumerate(pairs):
        ax.text(x, h / m[0], f"{h / m[0]:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(pairs)), [p[1] for p in pairs], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s, H100 ÷ H200")
    ax.set_title(f"{load('h100/' + H100_FILES[0])['gpu']} ÷ NVIDIA H200, same command (H200 at older commits)", fontsize=9)
    fig.tight_layout()
    save(fig, BENCH / "h100")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-plots", action="store_true", help="write the document only (no matplotlib needed)")
    args = ap.parse_args()
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        sys.exit("bench_report.py: matplotlib is missing (see the docstring for a venv), or pass --no-plots")
    text = document()
    links = re.findall(r"\]\(([^)#:]+)\)", text)  # relative links: files in docs/ and docs/bench/
    missing = [p for p in links if not p.endswith(".svg") and not (DOC.parent / p).exists()]
    if missing:
        sys.exit(f"bench_report.py: linked files missing: {missing}")
    if not args.no_plots:
        make_plots()
    svgs = [p for p in links if p.endswith(".svg") and not (DOC.parent / p).exists()]
    if svgs:
        sys.exit(f"bench_report.py: embedded plots missing: {svgs}")
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
