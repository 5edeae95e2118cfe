#!/usr/bin/env python3
"""Writes docs/BENCHMARKS.md and its plots (docs/bench/*.svg) from docs/bench/*.json.

    /tmp/mplvenv/bin/python tools/bench_report.py   # python3 -m venv /tmp/mplvenv; pip install matplotlib
    python3 tools/bench_report.py --no-plots        # the document only (stdlib)

The prose is tools/bench_report.md (a string.Template); every `${name}` in it — each table, data
line, command block, plot and figure quoted in the prose — is computed here from the JSON, so the
document holds only what the files say. Edit those two, not docs/BENCHMARKS.md. To publish a run,
put its `--json` output (GPU, commit, command recorded) in docs/bench/ and point a section at it.
"""
import json, pathlib, re, string, sys, textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH, DOC = ROOT / "docs" / "bench", ROOT / "docs" / "BENCHMARKS.md"
_cache, V, PLOTS = {}, {}, []


def load(n):
    return _cache.setdefault(n, json.loads((BENCH / n).read_text()))


def num(x, d=0): return "—" if x is None else f"{x:.{d}f}"
def pct(x, d=1): return "—" if x is None else f"{100 * x:.{d}f} %"
def times(x, d=2): return "—" if x is None else f"{x:.{d}f}×"
def span(xs, d=1, k=100, u=" %"):
    lo, hi = f"{k * min(xs):.{d}f}", f"{k * max(xs):.{d}f}"
    return (lo if lo == hi else f"{lo}–{hi}") + u
def table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
def data(n, date=True, extra=""):
    d = load(n); when = (d.get("date") or d.get("run_date")) if date else None
    return f"Data: [`{n}`](bench/{n}) — {d['gpu']}, commit{'s' if ',' in d['commit'] else ''} `{d['commit']}`" + (f", {when}" if when else "") + "." + extra
def cmds(lines): return "```sh\n" + "\n".join(lines) + "\n```"
def cmd_of(n): d = load(n); return cmds(d.get("commands") or [d["command"]])
def by(rows, *keys): return {tuple(r[k] for k in keys): r for r in rows}
def plot(stem, alt, fn):
    PLOTS.append((stem, fn)); return f"![{alt}](bench/{stem}.svg)"


# ---- derived figures ----
def coda_rel(r):
    m, w = r["min_coda_batch_size"], r["width"]
    return {1: "1", max(w // 4, 1): "W/4", max(w // 2, 1): "W/2", w: "W"}.get(m, str(m))
def same_run_cb(rows, r):
    cbs = [c for c in rows if c["mode"] == "cb" and c["width"] == r["width"]]
    return next((c for c in cbs if c.get("source") == r.get("source")), cbs[0] if cbs else None)
def decode_side(rows, r):
    """CB's decode device time per generated token ÷ depth batching's (core + coda), as a fraction of S."""
    cb, dev = same_run_cb(rows, r), lambda x, ks: sum(x["stages"][k]["device_s"] for k in ks if k in x["stages"])
    gen = lambda x: sum(v["rows"] for k, v in x["stages"].items() if k in ("prefill", "decode", "coda"))
    return (dev(cb, ["decode"]) / gen(cb)) / (dev(r, ["decode", "core", "coda"]) / gen(r)) / r["flop_bound"]
def speed(r): return f"{times(r['speedup_vs_cb'])} ({pct(r['fraction_of_bound'])})"


# ---- sections: each fills V with what the template names ----
def looped():
    d = load("looped_roofline.json")
    V["roof_model"] = d["model"]
    V["roof_table"] = table(["workload", "W", "decode tok/s", "step ms", "roofline ms", "of the roofline", "target", "commit", "note"], [[
        r["workload"], r["width"], num(r["decode_tokens_per_s"]), num(r["step_ms"], 2), num(r["roofline_ms"], 2), f"**{pct(r['fraction'])}**",
        pct(r["target"], 0) if r.get("target") else "—", f"`{r['commit']}`" + (f" ({r['runs']} runs)" if r["runs"] > 1 else ""),
        f"{times(r['speedup_vs_cb'])} over CB, {pct(r['fraction_of_prefill_adjusted_bound'])} of the prefill-adjusted bound" if r.get("speedup_vs_cb")
        else f"{r['prefill_tflops']:.0f} of {r['matmul_peak_tflops']:.0f} TFLOP/s" if r.get("prefill_tflops") else ""] for r in d["rows"]])
    groups = {}
    for c in dict.fromkeys(c for r in d["rows"] for c in r["commands"]):
        groups.setdefault(re.sub(r"--json \S+", "", c), []).append(c)
    V["roof_data"] = f"Data: [`looped_roofline.json`](bench/looped_roofline.json) — {d['gpu']}; each row names its commit. Commands:"
    V["roof_cmds"] = cmds(g[0] + (f"   # run {len(g)}×" if len(g) > 1 else "") for g in groups.values())
    V["roof_plot"] = plot("looped_roofline", "fraction of the roofline by workload and width", lambda d=d: bars(
        [f"{r['workload'][:28]}\nW {r['width']}" for r in d["rows"]], {"of the roofline": [r["fraction"] for r in d["rows"]]}, "fraction", d))
    n = "looped_cdb_9327f4f.json"; d = load(n); R = d["results"]
    cb = {r["width"]: r for r in R if r["mode"] == "cb"}
    ref = sorted((r for r in R if r["mode"] == "cdb-refill" and r["overlap"]), key=lambda r: r["width"])
    V.update(cdb_model=d["model"], cdb_data=data(n), cdb_cmds=cmd_of(n), cdb_plot=plot("looped_cdb_9327f4f", "CDB speed-up over CB by width", lambda n=n: speedups(n)))
    V["cdb_table"] = table(["W", "CB tok/s", "CDB refill + overlap tok/s", "d̄", "× over CB", "S", "of S", "decode side, of S", "of the prefill-adjusted bound", "GPU idle CB / CDB"], [[
        r["width"], num(cb[r["width"]]["tokens_per_s"]), num(r["tokens_per_s"]), num(r["mean_depth"], 2), f"**{times(r['speedup_vs_cb'])}**", times(r["flop_bound"]),
        f"**{pct(r['fraction_of_bound'])}**", pct(decode_side(R, r)), pct(r["fraction_of_prefill_adjusted_bound"]),
        f"{pct(cb[r['width']]['gpu_idle'])} / {pct(r['gpu_idle'])}"] for r in ref])
    g = load("looped_cdb.json")["results"]; lo, hi = sorted({r["target_mean_depth"] for r in g})
    pick = by(g, "width", "mode", "target_mean_depth"); gw = sorted({r["width"] for r in g})
    V["grid_slower"] = span([1 - pick[(w, "cb", lo)]["tokens_per_s"] / cb[w]["tokens_per_s"] for w in gw if w in cb])
    V["grid_table"] = table(["W", "CB tok/s", f"no-refill + overlap, d̄ {lo:g}", f"refill + overlap, d̄ {lo:g}", f"refill + overlap, d̄ {hi:g}"], [[
        w, num(pick[(w, "cb", lo)]["tokens_per_s"]), speed(pick[(w, "cdb-no-refill", lo)]), speed(pick[(w, "cdb-refill", lo)]), speed(pick[(w, "cdb-refill", hi)])] for w in gw])
    V.update(grid_data=data("looped_cdb.json"), grid_cmds=cmd_of("looped_cdb.json"), grid_plot=plot("looped_cdb", "no-refill and refill at two mean depths", lambda: speedups("looped_cdb.json")))
    n = "looped_cdb_2026-11-29a.json"; O = load(n)["results"]
    noexit = {r["target_mean_depth"] for r in O if r["flop_bound"] == 1.0}; t0, tn = min(r["target_mean_depth"] for r in O), max(noexit)
    f = {(r["width"], r["target_mean_depth"], bool(r["overlap"])): r for r in O if r["mode"] == "cdb-refill"}
    cell = lambda w, t, ov, k: "—" if (w, t, ov) not in f else pct(f[(w, t, ov)][k]) if k == "fraction_of_bound" else times(f[(w, t, ov)][k], 3)
    V.update(ov_t0=f"{t0:g}", ov_tn=f"{tn:g}", ov_data=data(n), ov_cmds=cmd_of(n), ov_plot=plot("looped_cdb_2026-11-29a", "overlap on and off, with and without early exit", lambda n=n: speedups(n)))
    V["ov_table"] = table(["W", f"sync, d̄ {t0:g}: of S", f"overlap, d̄ {t0:g}: of S", "sync, no exit: × over CB", "overlap, no exit: × over CB"], [
        [w, cell(w, t0, False, "fraction_of_bound"), cell(w, t0, True, "fraction_of_bound"), cell(w, tn, False, "speedup_vs_cb"), cell(w, tn, True, "speedup_vs_cb")]
        for w in sorted({w for (w, t, ov) in f if not ov and t not in noexit})])


def huginn():
    n = "looped_huginn.json"; d = load(n); R = d["results"]; c = [r for r in R if r["mode"] == "cdb-refill"]
    depths, w = sorted({r["target_mean_depth"] for r in c}, reverse=True), d["workload"]
    head = [h for t in depths for h in (f"d̄ {t:g} (S {span([r['flop_bound'] for r in c if r['target_mean_depth'] == t], 2, 1, '×')}): CDB tok/s", "× over CB", "of S", "of the prefill-adjusted bound")]
    rows = []
    for wd in sorted({r["width"] for r in c}):
        at = [next(r for r in c if (r["width"], r["target_mean_depth"]) == (wd, t)) for t in depths]
        rows.append([wd, " / ".join(dict.fromkeys(num(same_run_cb(R, r)["tokens_per_s"]) for r in at)), *[x for r in at for x in (
            num(r["tokens_per_s"]), f"**{times(r['speedup_vs_cb'])}**", f"**{pct(r['fraction_of_bound'])}**", pct(r["fraction_of_prefill_adjusted_bound"]))],
            " / ".join(dict.fromkeys(f"`{r['commit']}`" for r in at))])
    V.update(hug_model=d["model"], hug_table=table(["W", "CB tok/s", *head, "commit"], rows), hug_cmds=cmd_of(n),
             hug_workload=f"prompts lognormal with median {w['prompt']['median']:g} (≤ {w['prompt']['max']}), outputs median {w['output']['median']:g} (≤ {w['output']['max']}) tokens",
             hug_data=data(n) + " Commands:", hug_plot=plot("looped_huginn", "Huginn: speed-up over CB by width", lambda n=n: speedups(n)))
    n = "looped_huginn_short.json"; S = load(n)["results"]
    cfg = [("W/4", False, "coda W/4, no reserve (the paper's)"), ("W/2", True, "coda W/2, reserve"), ("W", True, "coda W, reserve")]
    find = lambda at, rel, res: next((r for r in at if r["mode"] == "cdb-refill" and coda_rel(r) == rel and (r["coda_reserve"] > 0) == res), None)
    rows = []
    for wd, t in sorted({(r["width"], r["target_mean_depth"]) for r in S}, key=lambda k: (-k[1], k[0])):
        at = [r for r in S if (r["width"], r["target_mean_depth"]) == (wd, t)]
        rows.append([wd, f"{t:g}", num(next(r for r in at if r["mode"] == "cb")["tokens_per_s"]), *[(lambda r: "—" if r is None else speed(r))(find(at, rel, res)) for rel, res, _ in cfg]])
    V.update(short_table=table(["W", "target d̄", "CB tok/s", *[x[2] for x in cfg]], rows), short_data=data(n) + " Commands:", short_cmds=cmd_of(n),
             short_plot=plot("looped_huginn_short", "Huginn short outputs: coda settings", lambda n=n: speedups(n)))
    V["paper_coda"] = span([r["fraction_of_bound"] for r in S if r["mode"] == "cdb-refill" and coda_rel(r) == "W/4" and r["coda_reserve"] == 0])
    V["full_coda"] = span([r["fraction_of_bound"] for r in S if r["mode"] == "cdb-refill" and coda_rel(r) == "W" and r["coda_reserve"] > 0])


def long_prompts():
    n = "long_prompts.json"; d = load(n); R = d["results"]; r0 = R[0]; lp = r0["long_prompts"]
    V["lp_intro"] = (f"{d['model']}, CB at W {r0['width']}: {r0['short_requests']} short requests ({r0['short_prompt_len']}-token prompts, {r0['short_new_tokens']} "
                     f"new tokens) decode while {len(lp)} long prompts of {min(lp)}–{max(lp)} tokens arrive {r0['arrival_gap_ms']} ms apart.")
    V["lp_table"] = table(["budget", "short decode tok/s", "short token gap p50 / p99 / max, ms", "long TTFT mean / max, s", "prefill launches", "engine time, prefill + decode, s"], [[
        f"{r['budget']} (chunked)" if r["budget"] != "unchunked" else f"unchunked (budget {r['max_num_batched_tokens']})", f"**{num(r['short_decode_tokens_per_s'])}**",
        f"{num(r['short_gap_p50_ms'])} / {num(r['short_gap_p99_ms'])} / **{num(r['short_max_gap_ms'])}**", f"{sum(r['long_ttft_s']) / len(r['long_ttft_s']):.2f} / {max(r['long_ttft_s']):.2f}",
        r["prefill_launches"], f"{r['prefill_s']:.2f} + {r['decode_s']:.2f} = {r['prefill_s'] + r['decode_s']:.2f}"] for r in R])
    V.update(lp_data=data(n), lp_cmds=cmd_of(n), lp_plot=plot("long_prompts", "long prompts: short decode rate, longest gap, TTFT by budget", lambda: bars(
        [str(r["budget"]) for r in R], {"short decode tok/s": [r["short_decode_tokens_per_s"] for r in R], "longest short gap, ms": [r["short_max_gap_ms"] for r in R],
                                        "long TTFT mean, s × 100": [100 * sum(r["long_ttft_s"]) / len(r["long_ttft_s"]) for r in R]}, "value", d)))


def diffusion():
    d, f = load("diffusion.json"), load("focus.json"); b = by(d["results"] + f["results"], "batch", "mode")
    rows = [[B, num(b[(B, "baseline")]["tokens_per_s"]), num(b[(B, "baseline-delayed")]["tokens_per_s"]), f"**{num(b[(B, 'focus')]['tokens_per_s'])}**",
             times(b[(B, "baseline-delayed")]["tokens_per_s"] / b[(B, "baseline")]["tokens_per_s"]), f"**{times(b[(B, 'focus')]['speedup_vs_baseline'])}**",
             times(b[(B, "focus")]["speedup_vs_delayed"]), f"{b[(B, 'baseline-delayed')]['tokens_per_step']:.1f} / {b[(B, 'focus')]['kept_per_step']:.1f}",
             f"{b[(B, 'baseline')]['decoded_per_step']:.2f} / {b[(B, 'focus')]['decoded_per_step']:.2f}"] for B in sorted({r["batch"] for r in d["results"]})]
    ph = [("o_proj_mlp_ms", "o_proj + MLP"), ("qkv_norm_rope_kv_write_ms", "QKV + norms + RoPE + K/V write"), ("attention_ms", "attention"), ("lm_head_readout_ms", "LM head + readout")]
    V.update(sdar_model=d["model"], sdar_workload=d["workload"], sdar_cmds=cmd_of("diffusion.json"),
             sdar_data=data("diffusion.json", extra=" FOCUS rows: [`focus.json`](bench/focus.json), the same run."),
             sdar_table=table(["B", "baseline tok/s", "delayed tok/s", "FOCUS tok/s", "delayed ÷ baseline", "FOCUS ÷ baseline", "FOCUS ÷ delayed",
                               "positions per request-step: delayed / FOCUS past layer 1", "decoded per request-step: baseline / FOCUS"], rows),
             sdar_phases=table(["B", "tokens", "step ms", *[p for _, p in ph]], [[r["batch"], r["tokens"], f"**{r['total_ms']:.1f}**",
                               *[f"{r[k]:.1f} ({100 * r[k] / r['total_ms']:.0f} %)" for k, _ in ph]] for r in sorted(d["breakdown"], key=lambda r: r["batch"])]),
             sdar_plot=plot("diffusion", "SDAR-8B: tokens/s by batch per mode", lambda d=d, f=f: modes(d["results"] + f["results"], d)))
    n, c = "llada2.json", load("llada2_3299c4f.json"); d = load(n); b = by(d["results"], "batch", "mode"); cb = by(c["results"], "batch", "mode")
    Bs = sorted({r["batch"] for r in c["results"]}); top = Bs[-1]
    V.update(l2_model=d["model"], l2_peak=f"{d['results'][0]['matmul_peak_tflops']:.0f}", l2_alpha=f"{d['focus']['alpha']:g}", l2_knee=d["focus"]["knee_tokens"],
             l2_workload=d["workload"], l2_data=data(n, date=False), l2_cmds=cmd_of(n), l2_plot=plot("llada2", "LLaDA2.0-mini: tokens/s by batch per mode", lambda d=d: modes(d["results"], d)))
    V["l2_table"] = table(["B", "baseline tok/s (of compute bound)", "delayed tok/s (of bound)", "FOCUS tok/s", "FOCUS ÷ baseline", "FOCUS ÷ delayed",
                           "FOCUS positions per request-step: layers 0–1 → past 1", "peak device memory, GB"], [[
        B, f"{num(b[(B, 'baseline')]['tokens_per_s'])} ({pct(b[(B, 'baseline')]['fraction_of_compute_bound'])})",
        f"{num(b[(B, 'baseline-delayed')]['tokens_per_s'])} ({pct(b[(B, 'baseline-delayed')]['fraction_of_compute_bound'])})", f"**{num(b[(B, 'focus')]['tokens_per_s'])}**",
        f"**{times(b[(B, 'focus')]['speedup_vs_baseline'])}**", f"**{times(b[(B, 'focus')]['speedup_vs_delayed'], 3)}**",
        f"{b[(B, 'focus')]['tokens_per_step']:.1f} → {b[(B, 'focus')]['kept_per_step']:.1f}", f"{max(b[(B, m)]['peak_device_memory_gb'] for m in ('baseline', 'baseline-delayed', 'focus')):.1f}"]
        for B in sorted({r["batch"] for r in d["results"]})])
    V["l2_confirm"] = (f"Confirmation run, same command at `{c['commit']}` ([`llada2_3299c4f.json`](bench/llada2_3299c4f.json)): baseline at B {top} "
                       f"{pct(cb[(top, 'baseline')]['fraction_of_compute_bound'])} of its bound; FOCUS ÷ delayed " + " / ".join(times(cb[(B, 'focus')]['speedup_vs_delayed']) for B in Bs)
                       + f" at B {' / '.join(map(str, Bs))}; FOCUS ÷ baseline {times(cb[(top, 'focus')]['speedup_vs_baseline'])} at B {top}.")
    b0 = min(B for B, _ in b); h = by(load("h100/earlier/diffusion_llada2_mini_43afb79.json")["results"], "batch", "mode")
    V.update(moe_b0=b0, moe_h200=times(b[(b0, "focus")]["speedup_vs_delayed"], 3), moe_h100=times(h[(b0, "focus")]["speedup_vs_delayed"], 3))
    n = "llada_modes.json"; d = load(n); b = by(d["results"], "batch", "mode"); M = [("exact", "exact"), ("prefix", "prefix cache"), ("dual", "dual cache")]
    V.update(ll_model=d["model"], ll_new=d["results"][0]["new_tokens"], ll_block=d["results"][0]["block"], ll_workload=d["workload"], ll_data=data(n, date=False), ll_cmds=cmd_of(n),
             ll_plot=plot("llada_modes", "LLaDA-8B: tokens/s of exact, prefix and dual cache", lambda d=d: modes(d["results"], d)))
    V["ll_table"] = table(["B", *[f"{lab} tok/s" + ("" if m == "exact" else " (÷ exact)") for m, lab in M], "positions per request-step: exact / prefix / dual", "launch ms", "peak device memory, GB"], [[
        B, *[num(b[(B, m)]["tokens_per_s"]) + ("" if m == "exact" else f" (**{times(b[(B, m)]['tokens_per_s'] / b[(B, 'exact')]['tokens_per_s'])}**)") for m, _ in M],
        " / ".join(f"{b[(B, m)]['tokens_per_step']:.1f}" for m, _ in M), " / ".join(f"{b[(B, m)]['launch_ms']:.1f}" for m, _ in M), f"{b[(B, 'exact')]['peak_device_memory_gb']:.1f}"]
        for B in sorted({r["batch"] for r in d["results"]})])


GATES = ["gate_overlap_q0.2_w16_64_9f27546.json", "gate_overlap_q0.2_w256_9f27546.json", "gate_overlap_q0.5_w16_64_3ed16d2.json", "gate_overlap_q0.5_w256_3ed16d2.json"]


def gates():
    rows, ratios, S = [], [], [("stock-sync", "(a) stock gate, synchronous"), ("delayed", "(b) stock gate delayed, overlap"), ("learned", "(c) learned lookahead, overlap")]
    for n in GATES:
        d = load(n); q = re.search(r"/q([0-9.]+)/", d["command"]).group(1)
        for w in sorted({r["width"] for r in d["results"]}):
            at = {r["depth_source"]: r for r in d["results"] if r["width"] == w and r["mode"] == "cdb-refill"}
            a, b, c = (at[s] for s, _ in S); ratios.append(b["tokens_per_s"] / a["tokens_per_s"])
            rows.append([q, w, num(next(r for r in d["results"] if r["width"] == w and r["mode"] == "cb")["tokens_per_s"]),
                         *[f"{num(x['tokens_per_s'])}, d̄ {x['mean_depth']:.2f}, idle {pct(x['gpu_idle'])}" for x in (a, b, c)],
                         f"**{times(c['tokens_per_s'] / a['tokens_per_s'])}**", times(c["tokens_per_s"] / b["tokens_per_s"])])
    V.update(gate_model=load(GATES[0])["model"], gate_delayed=span(ratios, 2, 1, "×"), gate_cmds=cmds(load(n)["command"] for n in GATES),
             gate_table=table(["q", "W", "CB tok/s", *[s + ": tok/s, d̄, GPU idle" for _, s in S], "(c) ÷ (a)", "(c) ÷ (b)"], rows),
             gate_data=f"Data ({load(GATES[0])['gpu']}): " + ", ".join(f"[`{n}`](bench/{n}) (`{load(n)['commit']}`)" for n in GATES) + ". Commands:",
             gate_plot=plot("gate_overlap", "trained gates with overlap: tokens/s per width", lambda: bars([r[0] + " W " + str(r[1]) for r in rows],
                            {s: [float(r[3 + i].split(",")[0]) for r in rows] for i, (_, s) in enumerate(S)}, "tokens/s", load(GATES[0]))))


def standing(card):
    """The standing benchmarks' tables and plot from docs/bench/<card>/ (every file but the A/Bs)."""
    files = sorted((p.name for p in (BENCH / card).glob("*.json") if not p.name.startswith("ab_")), key=lambda n: (not n.startswith("looped"), n))
    out = []
    for n in files:
        d = load(f"{card}/" + n); R = d["results"]; link = f"[`{card}/{n}`](bench/{card}/{n}), commit `{d['commit']}`: `{d['command']}`"
        if d.get("suite") == "cb":
            out += [f"**{d['model']}: CB, prompt {d['prompt_len']} + {d['new_tokens']} new** — {link}", "", table(["W", "decode tok/s", "step ms", "of the roofline", "peak device memory, GB"], [
                [r["width"], f"**refused** at build: “{r['refused']}”", "—", "—", "—"] if "refused" in r else
                [r["width"], num(r["tokens_per_s"]), num(r["decode_step_ms"], 2), pct(r["fraction_of_roofline"]), num(r["peak_device_memory_gb"], 1)] for r in R]), ""]
        elif d.get("suite") == "cdb":
            cb = {r["width"]: r for r in R if r["mode"] == "cb"}
            out += [f"**{d['model']}: depth batching against CB, d̄ {R[0]['target_mean_depth']:g}** — {link}", "", table(
                ["W", "CB tok/s", "CDB refill + overlap tok/s", "× over CB", "of S", "of the prefill-adjusted bound", "peak device memory, GB"], [
                [r["width"], num(cb[r["width"]]["tokens_per_s"]), num(r["tokens_per_s"]), times(r["speedup_vs_cb"]), pct(r["fraction_of_bound"]),
                 pct(r["fraction_of_prefill_adjusted_bound"]), num(r["peak_device_memory_gb"], 1)] for r in sorted((r for r in R if r["mode"] != "cb"), key=lambda r: r["width"])]), ""]
        else:
            b = by(R, "batch", "mode")
            # Against the delayed cache or the plain baseline, whichever the run measured.
            base, lab = ("baseline-delayed", "delayed") if any(m == "baseline-delayed" for _, m in b) else ("baseline", "baseline")
            out += [f"**{d['model']}: {'delayed cache' if lab == 'delayed' else 'baseline'} and FOCUS (α {d['focus']['alpha']:g}, knee {d['focus']['knee_tokens']})** — {link}", "", table(
                ["B", f"{lab} tok/s", "FOCUS tok/s", f"FOCUS ÷ {lab}", "peak device memory, GB"], [
                [B, num(b[(B, base)]["tokens_per_s"]), num(b[(B, "focus")]["tokens_per_s"]), times(b[(B, "focus")][f"speedup_vs_{lab}"]),
                 num(max(b[(B, m)]["peak_device_memory_gb"] for m in (base, "focus")), 1)] for B in sorted({r["batch"] for r in R})]), ""]
    figs = [(f"{load(f'{card}/' + n)['model'].split()[0]} {r['mode']} {'W' if 'width' in r else 'B'} {r.get('width', r.get('batch'))}", r["tokens_per_s"])
            for n in files for r in load(f"{card}/" + n)["results"] if "refused" not in r]
    d0 = load(f"{card}/" + files[0])  # a looped run: it measured the copy bandwidth
    V[f"{card}_plot"] = plot(card, f"{d0['gpu']} tokens/s of every figure above", lambda: bars([k for k, _ in figs], {"tokens/s": [v for _, v in figs]}, "tokens/s", d0))
    V.update({f"{card}_gpu": d0["gpu"], f"{card}_bw": f"{d0['copy_bandwidth_gb_s']:.0f}", f"{card}_kernels": max((load(f"{card}/" + n)["kernels"] for n in files), key=len),
              f"{card}_tables": "\n".join(out).rstrip(), f"{card}_commits": ", ".join(sorted({f"`{load(f'{card}/' + n)['commit']}`" for n in files}))})


def h100():
    standing("h100")
    standing("h200")
    ab = []
    for n in sorted(p.name for p in (BENCH / "h100").glob("ab_*.json")):
        a = load("h100/" + n); m = {}
        for run in a["runs"]:
            for r in run["result"]["results"]:
                m.setdefault((r["mode"], r.get("width", r.get("batch"))), {}).setdefault(run["variant"], []).append(r["tokens_per_s"])
        avg = lambda v: sum(v) / len(v)
        ab.append([f"[`{n}`](bench/h100/{n})", f"`{a['old_commit']}` → `{a['new_commit']}`", "; ".join(f"{k[0]} {k[1]}: {100 * (avg(v['new']) / avg(v['old']) - 1):+.1f} %" for k, v in m.items())])
    V["h100_ab"] = table(["A/B", "old → new", "new ÷ old − 1, mean of the alternated runs"], ab)


def serve():
    n = "serve_h100_d210528.json"; d = load(n); R = d["runs"]; share = [r["server_tokens_per_s"] / r["in_process_tokens_per_s"] for r in R]
    V["serve_mean"] = pct(sum(share) / len(share))
    c = "serve_cpu_d210528.json"; dc = load(c); cs = [r["server_tokens_per_s"] / r["in_process_tokens_per_s"] for r in dc["runs"]]
    V.update(serve_cpu=f"{dc['model']} on the CPU, {dc['requests']} requests of {dc['max_tokens']} tokens, {dc['clients']} streaming clients: "
             f"{num(min(r['in_process_tokens_per_s'] for r in dc['runs']))}–{num(max(r['in_process_tokens_per_s'] for r in dc['runs']))} tokens/s in-process; "
             f"the server at {span(cs)} of it per round, {pct(sum(cs) / len(cs))} over all rounds", serve_cpu_data=data(c), serve_cpu_cmds=cmd_of(c))
    V.update(serve_intro=f"{d['model']}, W {d['clients']}: {d['requests']} greedy requests of {d['max_tokens']} tokens, {d['clients']} streaming clients", serve_data=data(n), serve_cmds=cmd_of(n), serve_table=table(
        ["round", "in-process tok/s", "server tok/s", "server ÷ in-process", "HTTP path, µs per token"], [[r["round"], num(r["in_process_tokens_per_s"]), num(r["server_tokens_per_s"]), pct(s),
        f"{1e6 * (r['server_s'] / r['server_tokens'] - r['in_process_s'] / r['in_process_tokens']):+.1f}"] for r, s in zip(R, share)]), serve_share=span(share),
        serve_plot=plot("serve", "server and in-process tokens/s per round", lambda: bars([f"round {r['round']}" for r in R], {"in-process": [r["in_process_tokens_per_s"] for r in R], "server": [r["server_tokens_per_s"] for r in R]}, "tokens/s", d)))


def live():
    """Latency against request rate (docs/bench/live/): the burst row first (its drain rate is the knee), then the rates."""
    def sweep(stem, files, base):
        D = {label: load(f"live/{f}") for label, f in files.items()}
        knee = {k: d["runs"][0]["summary"]["request_throughput"] for k, d in D.items()}
        rates = [r["rate"] for r in D[base]["runs"][1:]]
        at = lambda k, rate: next(r["summary"] for r in D[k]["runs"][1:] if r["rate"] == rate)
        return D, knee, rates, at
    def curves(title, D, rates, at, metrics, d0):
        f, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
        f.suptitle("\n".join(textwrap.wrap(title, 130)), fontsize=8)
        for ax, (key, stat, ylabel) in zip(axes, metrics):
            for k in D:
                ax.plot(rates, [at(k, r)[key][stat] for r in rates], "o-", label=k)
            ax.set_xlabel("offered requests/s"); ax.set_ylabel(ylabel, fontsize=8); ax.grid(True, alpha=0.3); ax.set_yscale("log")
        axes[0].legend(fontsize=7); return f
    # Ouro-1.4B: CB against depth batching.
    files = {"CB": "ouro_sharegpt_w64_cb.json", "CDB refill": "ouro_sharegpt_w64_cdb-refill.json", "CDB no-refill": "ouro_sharegpt_w64_cdb-no-refill.json"}
    D, knee, rates, at = sweep("live_ouro", files, "CB"); d0 = D["CB"]
    norm = lambda k, r: at(k, r)["normalized_ms"]
    rows = [[f"{r:.2f} ({pct(r / knee['CB'], 0)})", *[f"{num(norm(k, r)['mean'], 1)} / {num(norm(k, r)['p99'], 1)}" for k in D],
             times(norm("CDB refill", r)["mean"] / norm("CB", r)["mean"]), times(norm("CDB no-refill", r)["mean"] / norm("CB", r)["mean"]),
             " / ".join(num(at(k, r)["ttft_ms"]["p99"]) for k in D), " / ".join(num(at(k, r)["request_throughput"], 1) for k in D)] for r in rates]
    V.update(live_ouro_intro=f"{d0['target'].split(', in process')[0]}, W {d0['width']}, exit depths replayed with mean {d0['settings'].get('depths', {}).get('mean', 2.5) if d0['settings'] else 2.5}"
             f" ({re.sub('(?<!^)(?=[A-Z])', '-', D['CDB refill']['settings']['layout']).lower()} K/V, overlap {'on' if D['CDB refill']['settings']['overlap'] else 'off'}); ShareGPT-like lengths (prompt median {d0['lengths']['prompt']['median']:g}, output median {d0['lengths']['output']['median']:g})",
             live_knees=", ".join(f"{k} **{num(v, 1)} req/s**" + ("" if k == "CB" else f" ({times(v / knee['CB'])})") for k, v in knee.items()),
             live_ouro_table=table(["offered req/s (of CB's knee)", *[f"{k}: normalized ms, mean / p99" for k in D], "refill ÷ CB", "no-refill ÷ CB", "TTFT p99 ms: " + " / ".join(D), "completed req/s"], rows),
             live_ouro_data=data("live/" + files["CB"], date=False, extra=f" The other modes: [`{files['CDB refill']}`](bench/live/{files['CDB refill']}), [`{files['CDB no-refill']}`](bench/live/{files['CDB no-refill']}) (commit `{D['CDB no-refill']['commit']}`)."),
             live_ouro_cmds=cmds([d0["burst_command"], *[d["command"] for d in D.values()]]),
             live_low=span([norm("CDB refill", r)["mean"] / norm("CB", r)["mean"] for r in rates if 0.45 < r / knee["CB"] < 1.05], d=2, k=1, u="×"),
             live_nr_share=span([(1 - norm("CDB no-refill", r)["mean"] / norm("CB", r)["mean"]) / (1 - norm("CDB refill", r)["mean"] / norm("CB", r)["mean"]) for r in rates if 0.45 < r / knee["CB"] < 1.05], d=0),
             live_over=times(norm("CDB refill", rates[-1])["mean"] / norm("CB", rates[-1])["mean"]),
             live_ouro_plot=plot("live_ouro", "normalized latency and time to first token against request rate", lambda D=D, rates=rates, at=at, d0=d0: curves(f"{d0['target'].split(', in process')[0]}, W {d0['width']} — {d0['gpu']}, commit {d0['commit']}", D, rates, at,
                                 [("normalized_ms", "mean", "normalized latency, mean (ms per token)"), ("normalized_ms", "p99", "normalized latency, p99"), ("ttft_ms", "p99", "time to first token, p99 (ms)")], d0)))
    # The diffusion models: the baseline against FOCUS.
    def diffusion(key, files):
        D, knee, rates, at = sweep(key, files, "baseline"); d0 = D["baseline"]
        rows = [[f"{r:.2f} ({pct(r / knee['baseline'], 0)})", *[f"{num(at(k, r)['tpot_ms']['p50'], 1)} / {num(at(k, r)['tpot_ms']['p99'], 1)}" for k in D],
                 " / ".join(num(at(k, r)["normalized_ms"]["mean"], 1) for k in D), " / ".join(num(at(k, r)["ttft_ms"]["p99"]) for k in D), " / ".join(num(at(k, r)["request_throughput"], 1) for k in D)] for r in rates]
        st = d0["settings"]
        V.update({f"{key}_intro": f"{d0['target'].split(', in process')[0]}, W {d0['width']}, blocks of {st['block']}, {st['realised_mean_unmask']:g} tokens revealed per step (replayed); ShareGPT-like lengths",
                  f"{key}_knees": ", ".join(f"{k} **{num(v, 1)} req/s**" + ("" if k == "baseline" else f" ({times(v / knee['baseline'])})") for k, v in knee.items()),
                  f"{key}_table": table(["offered req/s (of the baseline's knee)", *[f"{k}: TPOT ms p50 / p99" for k in D], "normalized ms, mean: " + " / ".join(D), "TTFT p99 ms", "completed req/s"], rows),
                  f"{key}_data": data("live/" + files["baseline"], date=False, extra=" The other modes: " + ", ".join(f"[`{f}`](bench/live/{f})" for f in list(files.values())[1:]) + "."),
                  f"{key}_cmds": cmds([d0["burst_command"], *[d["command"] for d in D.values()]]),
                  f"{key}_plot": plot(key, "time per output token and normalized latency against request rate", lambda D=D, rates=rates, at=at, d0=d0: curves(f"{d0['target'].split(', in process')[0]}, W {d0['width']} — {d0['gpu']}, commit {d0['commit']}", D, rates, at,
                                      [("tpot_ms", "p50", "time per output token, p50 (ms)"), ("tpot_ms", "p99", "time per output token, p99 (ms)"), ("normalized_ms", "mean", "normalized latency, mean (ms per token)")], d0))})
        return D, knee, rates, at
    files = {"baseline": "sdar8b_sharegpt_w64_baseline.json", "FOCUS": "sdar8b_sharegpt_w64_focus.json", "FOCUS, knee 256": "sdar8b_sharegpt_w64_knee256_focus.json"}
    D, knee, rates, at = diffusion("live_sdar", files)
    tp99 = lambda k, r: at(k, r)["tpot_ms"]["p99"]
    V.update(live_sdar_low=f"{times(tp99('FOCUS', rates[0]) / tp99('baseline', rates[0]))} the baseline's ({times(tp99('FOCUS, knee 256', rates[0]) / tp99('baseline', rates[0]))} with the knee)",
             live_sdar_ttft=f"p50 {num(at('FOCUS', rates[0])['ttft_ms']['p50'])} ms against {num(at('baseline', rates[0])['ttft_ms']['p50'])} ms",
             live_sdar_mid=times(tp99("FOCUS", rates[2]) / tp99("baseline", rates[2])))
    files = {"baseline": "llada2mini_sharegpt_w64_baseline.json", "FOCUS": "llada2mini_sharegpt_w64_focus.json"}
    D, knee, rates, at = diffusion("live_llada2", files)
    tp99 = lambda k, r: at(k, r)["tpot_ms"]["p99"]
    below = [r for r in rates if r <= knee["baseline"] * 1.01]
    top = rates[-1]
    V.update(live_llada2_tpot=", ".join(times(tp99("FOCUS", r) / tp99("baseline", r)) for r in below),
             live_llada2_top=f"{num(at('FOCUS', top)['request_throughput'], 1)} req/s against {num(at('baseline', top)['request_throughput'], 1)}, TTFT p99 {num(at('FOCUS', top)['ttft_ms']['p99'])} ms against {num(at('baseline', top)['ttft_ms']['p99'])}, "
                             f"normalized latency {num(at('FOCUS', top)['normalized_ms']['mean'], 1)} ms against {num(at('baseline', top)['normalized_ms']['mean'], 1)}",
             live_llada2_fracs=" / ".join(pct(r / knee["baseline"], 0) for r in below))
    off = by(load("h100/earlier/diffusion_llada2_mini_baseline_3348732.json")["results"], "batch", "mode")
    V["live_llada2_offline"] = f"{times(off[(256, 'focus')]['speedup_vs_baseline'])} on the H100 ([`h100/earlier/diffusion_llada2_mini_baseline_3348732.json`](bench/h100/earlier/diffusion_llada2_mini_baseline_3348732.json))"
    # The burst's denoise launches: how many, and their mean length.
    burst = {k: D[k]["runs"][0]["engine"]["stages"]["denoise"] for k in D}
    per = {k: b["seconds"] / b["launches"] for k, b in burst.items()}
    V.update(live_llada2_burst=f"FOCUS's launches carry {burst['FOCUS']['tokens'] / 1e3:.0f}k tokens against {burst['baseline']['tokens'] / 1e3:.0f}k and take {num(per['FOCUS'] * 1e3, 1)} ms against {num(per['baseline'] * 1e3, 1)}, "
                                  f"but it runs {burst['FOCUS']['launches']} of them against {burst['baseline']['launches']}")


def did_not_pay():
    sk = load("skinny_gemm_ab.json"); m = {}
    for run in sk["runs"]:
        for r in run["result"]["results"]:
            m.setdefault((run["variant"], r["width"]), []).append(r["tokens_per_s"])
    ws, avg = sorted({w for _, w in m}), lambda v, w: sum(m[(v, w)]) / len(m[(v, w)])
    # The weight-streaming GEMM: the first layout on every layer and the second on the narrow
    # layers, each in the CB step against cuBLAS on the H100.
    sn = "stream_gemm/h100_ab_e0fa080.json"; S = load(sn)["runs"]
    def sstep(stem, w, R=S, rounds=(1, 2)):
        v = [r["decode_step_ms"] for i in rounds if f"{stem}_{i}" in R for r in R[f"{stem}_{i}"]["results"] if r.get("width") == w]
        return sum(v) / len(v)
    nn = "stream_gemm/h100_step_narrow_4a6957a.json"; N = load(nn)["runs"]
    ln = "stream_gemm/h100_layers_945d968.json"; L = load(ln)["runs"]
    narrow = {w: sstep("cb_arena", w, N) / sstep("cb_narrow", w, N) for w in (1, 16)}
    cdb = {k: {r["mode"]: r["tokens_per_s"] for r in N[k]["results"]} for k in ("cdb_arena", "cdb_narrow")}
    V.update(stream_gemm_step=" / ".join(times(sstep("cublas", w) / sstep("stream", w)) for w in (16, 64)),
             stream_narrow_step=" / ".join(times(narrow[w]) for w in (1, 16)),
             stream_narrow_cdb=span([cdb["cdb_narrow"][m] / cdb["cdb_arena"][m] for m in ("cb", "cdb-refill")], d=2, k=1, u="×"),
             stream_gemm_data=data(sn, date=False), stream_narrow_data=data(nn, date=False), stream_gemm_gpu=load(sn)["gpu"],
             stream_oproj_eager=f"{next(min(r['cublas_s']) for r in L['gemm_ouro']['results'] if r['layer'] == 'o_proj' and r['rows'] == 16 and r['planned']) * 1e6:.1f}",
             stream_layers_data=data(ln, date=False))
    g = load("looped_cdb.json")["results"]; t = min(r["target_mean_depth"] for r in g)
    V.update(skinny=" / ".join(times(avg("new", w) / avg("old", w)) for w in ws), skinny_w=" / ".join(map(str, ws)), skinny_gpu=sk["gpu"], nr_t=f"{t:g}",
             nr=span([r["fraction_of_bound"] for r in g if r["mode"] == "cdb-no-refill" and r["target_mean_depth"] == t]),
             rf=span([r["fraction_of_bound"] for r in g if r["mode"] == "cdb-refill" and r["target_mean_depth"] == t]))


def fp8():
    n = "fp8_h200.json"; d = load(n); R = d["runs"]
    def cb(label, w): return sum(next(r["tokens_per_s"] for r in R[f"{label}{i}"]["results"] if r["width"] == w) for i in (1, 2)) / 2
    rows = [(1, "weight-only kernel", "fp8_wo"), (16, "weight-only kernel", "fp8_wo"), (64, "W8A8 (by-shape)", "fp8_bs")]
    dec = [[f"W {w}", path, num(cb("bf16_cb", w)), num(cb(lab, w)), times(cb(lab, w) / cb("bf16_cb", w))] for w, path, lab in rows]
    sd = {(r["mode"], q): r for q in ("bf16", "fp8") for r in R[f"sdar_{q}"]["results"]}
    den = [[f"B 256 {m}", "W8A8 (by-shape)", num(sd[(m, "bf16")]["tokens_per_s"]), num(sd[(m, "fp8")]["tokens_per_s"]), times(sd[(m, "fp8")]["tokens_per_s"] / sd[(m, "bf16")]["tokens_per_s"])]
           for m in ("baseline", "focus")]
    f8 = sd[("baseline", "fp8")]
    V.update(fp8_data=data(n), fp8_cmds=cmds(d["commands"]), fp8_table=table(["launch", "FP8 path", "bf16 tok/s", "FP8 tok/s", "FP8 ÷ bf16"], dec + den),
             fp8_peak=num(f8["fp8_linear_peak_tflops"]), fp8_bf16_peak=num(f8["matmul_peak_tflops"]), fp8_bound=pct(f8["fraction_of_compute_bound"]),
             fp8_focus=times(sd[("focus", "fp8")]["tokens_per_s"] / f8["tokens_per_s"]), bf16_focus=times(sd[("focus", "bf16")]["tokens_per_s"] / sd[("baseline", "bf16")]["tokens_per_s"]),
             fp8_plot=plot("fp8", "FP8 tokens/s over bf16 per launch shape", lambda: bars([r[0] for r in dec + den], {"FP8 ÷ bf16": [float(r[4].rstrip("×")) for r in dec + den]}, "tokens/s, FP8 ÷ bf16",
                                                                                  {"model": "Ouro-1.4B decode and SDAR-8B denoising, FP8 against bf16", "gpu": d["gpu"], "commit": d["commit"]})))


def fp8_h100():
    n = "fp8/h100_decode_ab_2d346d3.json"; R = load(n)["runs"]
    def cb(label, w):
        v = [r["tokens_per_s"] for i in (1, 2) for r in R[f"{label}_{i}"]["results"] if r.get("width") == w and "tokens_per_s" in r]
        return sum(v) / len(v) if v else None
    rows = [(1, "tensor-core weight-only", "cb_mma"), (16, "tensor-core weight-only", "cb_mma"), (64, "tensor-core weight-only", "cb_mma"),
            (1, "SIMT weight-only", "cb_simt"), (16, "SIMT weight-only", "cb_simt"), (64, "W8A8 (by-shape)", "cb_byshape")]
    dec = [[f"W {w}", path, num(cb("cb_bf16", w)), num(cb(lab, w)), times(cb(lab, w) / cb("cb_bf16", w))] for w, path, lab in rows]
    m = "fp8/h100_diffusion_huginn_2d346d3.json"; D = load(m)["runs"]
    def den(model, label):
        sd = {(r["mode"], r["batch"], q): r["tokens_per_s"] for q in ("bf16", "fp8") for r in D[f"{label}_{q}"]["results"]}
        return [[f"{model} B {b} {mode}", "W8A8 (by-shape)", num(sd[(mode, b, "bf16")]), num(sd[(mode, b, "fp8")]), times(sd[(mode, b, "fp8")] / sd[(mode, b, "bf16")])]
                for b in (32, 256) for mode in ("baseline", "focus")]
    hg = {(r["width"], q): r["tokens_per_s"] for q in ("bf16", "fp8") for r in D[f"huginn_{q}"]["results"]}
    hug = [[f"Huginn W {w}", "by-shape", num(hg[(w, "bf16")]), num(hg[(w, "fp8")]), times(hg[(w, "fp8")] / hg[(w, "bf16")])] for w in (1, 16, 64)]
    V.update(fp8_h100_table=table(["launch", "FP8 path", "bf16 tok/s", "FP8 tok/s", "FP8 ÷ bf16"], dec + den("SDAR-8B", "sdar") + den("LLaDA2.0-mini", "llada2") + hug),
             fp8_h100_data=data(n, date=False) + " " + data(m, date=False), fp8_h100_cmds=cmds(load(n)["commands"] + load(m)["commands"]))


def fp8_rows():
    n = "fp8/h100_weight_only_rows_ab_47aa5b1.json"; R = load(n)["runs"]
    def mean(stem, w, key="tokens_per_s"):
        v = [r[key] for i in (1, 2) for r in R[f"{stem}_{i}"]["results"] if r.get("width") == w and key in r]
        return sum(v) / len(v) if v else None
    cell = lambda stem, w: "—" if mean(stem, w) is None else f"{num(mean(stem, w))} ({times(mean(stem, w) / mean('cb_bf16', w))})"
    rows = [[f"W {w}", num(mean("cb_bf16", w)), cell("cb_wo_old", w), cell("cb_w8a8", w)] for w in (16, 32, 64)]
    m = "fp8/h100_llada2_promoted_47aa5b1.json"; L = load(m)["runs"]
    sd = {(r["mode"], r["batch"], q): r["tokens_per_s"] for q in ("bf16", "fp8") for r in L[f"llada2_{q}"]["results"]}
    lrows = [[f"B {b} {mode}", num(sd[(mode, b, "bf16")]), num(sd[(mode, b, "fp8")]), times(sd[(mode, b, "fp8")] / sd[(mode, b, "bf16")])] for b in (32, 256) for mode in ("baseline", "focus")]
    h = "huginn/attention_prep_ab_47aa5b1.json"; H = load(h)["runs"]
    def hg(stem, w, key):
        v = [r[key] for i in (1, 2) for r in H[f"{stem}_{i}"]["results"] if r.get("width") == w]
        return sum(v) / len(v)
    hrows = [[f"W {w}", f"{hg('huginn_old', w, 'decode_step_ms'):.2f}", f"{hg('huginn_new', w, 'decode_step_ms'):.2f}", times(hg("huginn_old", w, "decode_step_ms") / hg("huginn_new", w, "decode_step_ms"), 3),
              f"{pct(hg('huginn_old', w, 'fraction_of_roofline'))} → {pct(hg('huginn_new', w, 'fraction_of_roofline'))}",
              f"{next(r['graph_kernel_nodes'] for r in H['huginn_old_1']['results'] if r['width'] == w)} → {next(r['graph_kernel_nodes'] for r in H['huginn_new_1']['results'] if r['width'] == w)}"] for w in (16, 64)]
    V.update(fp8_rows_table=table(["launch", "bf16 tok/s", "FP8 weight-only tok/s", "FP8 W8A8 tok/s"], rows),
             fp8_rows_wo_roof=span([mean("cb_wo_old", w, "fraction_of_roofline") for w in (16, 32, 64)]),
             fp8_rows_data=data(n, date=False), fp8_rows_cmds=cmds(load(n)["commands"]),
             llada2_promoted_table=table(["launch", "bf16 tok/s", "FP8 tok/s", "FP8 ÷ bf16"], lrows), llada2_promoted_data=data(m, date=False),
             huginn_prep_table=table(["launch", "step ms before", "step ms after", "before ÷ after", "of the roofline", "kernels in its graphs"], hrows),
             huginn_prep_data=data(h, date=False), huginn_prep_cmds=cmds(load(h)["commands"]))
    # Where the weight-only kernel's time goes: ncu per layer shape.
    q = "fp8/h100_weight_only_ncu_3348732.json"; Q = load(q)["results"]
    label = {"fp8_w16": "FP8 weight-only, 16 rows", "fp8_w64": "FP8 weight-only, 64 rows", "bf16_w16": "bf16 cuBLAS, 16 rows"}
    qrows = [[r["layer"], label[r["run"]], f"{r['time_us']:.1f}", num(r["dram_read_gb_s"]), pct(r["warps_active_pct"] / 100, 0) if "warps_active_pct" in r else "—",
              str(int(r["registers"])) if "registers" in r else "—"] for r in sorted(Q, key=lambda r: (r["layer"], r["run"]))]
    w16 = [r for r in Q if r["run"] == "fp8_w16"]
    # The pipelined weight-only kernel against the plain one, alternated in one call.
    pn = "fp8/h100_pipe_ab_e0fa080.json"; P = load(pn)["runs"]
    def pstep(stem, w, key="decode_step_ms"):
        v = [r[key] for i in (1, 2) for r in P[f"{stem}_{i}"]["results"] if r.get("width") == w]
        return sum(v) / len(v)
    pw = (1, 16, 32, 64)
    prows = [[f"W {w}", f"{pstep('plain', w):.2f}", f"{pstep('pipe', w):.2f}", times(pstep("plain", w) / pstep("pipe", w), 3),
              f"{pct(pstep('plain', w, 'fraction_of_roofline'))} → {pct(pstep('pipe', w, 'fraction_of_roofline'))}"] for w in pw]
    V.update(fp8_pipe_table=table(["launch", "plain step ms", "pipelined step ms", "plain ÷ pipelined", "of the roofline"], prows),
             fp8_pipe_span=span([pstep("plain", w) / pstep("pipe", w) for w in pw], d=2, k=1, u="×"), fp8_pipe_data=data(pn, date=False), fp8_pipe_cmds=cmds(load(pn)["commands"]))
    V.update(fp8_ncu_table=table(["layer", "kernel", "µs a launch", "DRAM read GB/s", "warps active", "registers a thread"], qrows), fp8_ncu_data=data(q, date=False), fp8_ncu_cmds=cmds(load(q)["commands"]),
             fp8_ncu_bw=span([r["dram_read_gb_s"] for r in w16], d=0, k=1, u=" GB/s"), fp8_ncu_warps=span([r["warps_active_pct"] for r in Q if "warps_active_pct" in r], d=0, k=1, u=" %"),
             fp8_ncu_cublas=span([r["dram_read_gb_s"] for r in Q if r["run"] == "bf16_w16"], d=0, k=1, u=" GB/s"))


def gemm_layers():
    n = "gemm/h100_layers_8eeb2b5.json"; G = load(n)["runs"]
    rows = []
    for suite, widths in (("gemm_ouro", (1, 16, 64)), ("gemm_huginn", (16, 64))):
        for r in G[suite]["results"]:
            if r["rows"] in widths and r["output"] != "Fp8Whole" and (r["output"] != "Partials" or r["planned"]):
                sl = f" in {r['slices']}" if r["slices"] > 1 else ""
                rows.append([r["model"], r["layer"], f"{r['n']} × {r['k']}{sl}", r["rows"], f"{min(r['eager_s']) * 1e6:.1f}", f"{min(r['graph_s']) * 1e6:.1f}", pct(r["graph_of_copy_bandwidth"])])
    # A full-depth W 16 step of Ouro-1.4B: 96 of each layer (24 layers × 4 loop steps) and the head.
    lay = {r["layer"]: r for r in G["gemm_ouro"]["results"] if r["rows"] == 16 and r["output"] != "Fp8Whole" and (r["output"] != "Partials" or r["planned"])}
    apps = 96
    core = ("qkv", "o_proj", "gate_up", "down")
    prod_s = apps * sum(min(lay[k]["graph_s"]) for k in core) + min(lay["head"]["graph_s"])
    bw = G["gemm_ouro"]["copy_bandwidth_gb_s"] * 1e9
    bytes_s = (apps * sum(lay[k]["weight_bytes"] for k in core) + lay["head"]["weight_bytes"]) / bw
    N = load("stream_gemm/h100_step_narrow_4a6957a.json")["runs"]
    step = next(r["decode_step_ms"] for r in N["cb_arena_2"]["results"] if r.get("width") == 16)
    # Where a split count other than the plan's measured faster by more than 3 %.
    better = []
    for suite in ("gemm_ouro", "gemm_huginn"):
        R = [r for r in G[suite]["results"] if r["output"] == "Partials"]
        for r in R:
            if r["planned"]:
                best = min((x for x in R if x["layer"] == r["layer"] and x["rows"] == r["rows"]), key=lambda x: min(x["graph_s"]))
                gain = min(r["graph_s"]) / min(best["graph_s"])
                if gain > 1.03:
                    better.append(f"{r['model']} {r['layer']} at {r['rows']} rows: {best['slices']} slices {times(gain)} the plan's {r['slices']}")
    V.update(gemm_table=table(["model", "layer", "n × k (k slices)", "rows", "eager µs", "graph µs", "graph, of copy bandwidth"], rows),
             gemm_step_ms=f"{prod_s * 1e3:.2f}", gemm_ideal_ms=f"{bytes_s * 1e3:.2f}", gemm_cb16_ms=f"{step:.2f}", gemm_share=pct(prod_s * 1e3 / step, d=0),
             gemm_gpu=load(n)["gpu"], gemm_of_bw=pct(bytes_s / prod_s, d=0), gemm_splits="; ".join(better) if better else "none", gemm_data=data(n, date=False), gemm_cmds=cmds(load(n)["commands"]))


def fp8_layers():
    """FP8 weight-only per layer in a graph against cuBLAS bf16 (H200), whole and in k slices."""
    n = "gemm/h200_fp8_layers_39be911.json"; G = load(n)["runs"]
    rows, labels, bf16_bw, fp8_bw = [], [], [], []
    for suite in ("gemm_fp8_ouro", "gemm_fp8_huginn"):
        R = G[suite]["results"]
        bf16 = {(r["layer"], r["rows"]): r for r in R if r["output"] != "Fp8Whole" and r["output"] != "Fp8Partials" and (r["output"] != "Partials" or r["planned"])}
        fp8 = {}
        for r in R:
            if r["output"] in ("Fp8Whole", "Fp8Partials"):
                fp8.setdefault((r["layer"], r["rows"]), []).append(r)
        for key, rs in fp8.items():
            b = bf16[key]; whole = next(r for r in rs if r["slices"] == 1); best = min(rs, key=lambda r: min(r["graph_s"]))
            sl = f"{best['slices']} slices" if best["slices"] > 1 else "whole"
            rows.append([whole["model"], key[0], f"{whole['n']} × {whole['k']}", key[1], f"{min(b['graph_s']) * 1e6:.1f}", pct(b["graph_of_copy_bandwidth"]),
                         f"{min(whole['graph_s']) * 1e6:.1f}", pct(whole["graph_of_copy_bandwidth"]), f"{min(best['graph_s']) * 1e6:.1f} ({sl})", times(best["bf16_over_fp8"])])
            labels.append(f"{whole['model'].split('-')[0]} {key[0]} {key[1]}"); bf16_bw.append(100 * b["graph_of_copy_bandwidth"]); fp8_bw.append(100 * best["graph_of_copy_bandwidth"])
    d = G["gemm_fp8_ouro"]
    V.update(fp8_layers_table=table(["model", "layer", "n × k", "rows", "bf16 µs", "bf16, of copy bw", "FP8 whole µs", "FP8 whole, of copy bw", "FP8 best µs", "bf16 ÷ FP8 best"], rows),
             fp8_layers_gpu=d["gpu"], fp8_layers_data=data(n, date=False), fp8_layers_cmds=cmds(load(n)["commands"]),
             fp8_layers_plot=plot("fp8_layers", "share of the copy bandwidth per decode layer, bf16 cuBLAS against the FP8 weight-only kernel, in a graph",
                                  lambda: bars(labels, {"bf16 cuBLAS": bf16_bw, "FP8 weight-only (best split)": fp8_bw}, "% of copy bandwidth", {"model": "decode layers", "gpu": d["gpu"], "commit": d["commit"]})))
    S = load("fp8/h200_split_k_39be911.json")["runs"]
    step = lambda k, w: next(r["decode_step_ms"] for r in S[k]["results"] if r["width"] == w)
    ab = []
    for w in (1, 16, 64):
        whole = [step(f"fp8_whole_{i}", w) for i in (1, 2)]; split = [step(f"fp8_split_{i}", w) for i in (1, 2)]
        ab.append([f"W {w}", " / ".join(f"{x:.2f}" for x in whole), " / ".join(f"{x:.2f}" for x in split), times(sum(whole) / sum(split), 3), f"{step('bf16_arena', w):.2f}"])
    V.update(fp8_split_table=table(["launch", "whole step ms (2 runs)", "split step ms (2 runs)", "whole ÷ split", "bf16 arena step ms"], ab),
             fp8_split_data=data("fp8/h200_split_k_39be911.json", date=False), fp8_split_cmds=cmd_of("fp8/h200_split_k_39be911.json"))


def roofline_breakdown():
    """Where one CB W 16 step's kernel time goes (ncu, H200, on the arena)."""
    n = "roofline/h200_cb_w16_arena_kernels_39be911.json"; d = load(n)
    fams = sorted(d["families"].items(), key=lambda kv: -kv[1]["ms"])
    rows = [[f, v["kernels"], f"{v['ms']:.3f}", pct(v["ms"] / d["total_ms"])] for f, v in fams]
    per = d["by_position"]
    V.update(breakdown_table=table(["family", "kernels", "ms", "share"], rows), breakdown_total=f"{d['total_ms']:.2f}", breakdown_kernels=d["kernels"],
             breakdown_layer=table(["#", "kernel", "family", "mean µs"], [[i, f"`{r['kernel']}`", r["family"], f"{r['mean_us']:.2f}"] for i, r in enumerate(per)]),
             breakdown_step=f"{next(r['decode_step_ms'] for r in load('fp8/h200_split_k_39be911.json')['runs']['bf16_arena']['results'] if r['width'] == 16):.2f}",
             breakdown_data=data(n, date=False), breakdown_cmds=cmd_of(n))


def arena():
    n = "arena/h100_ab_2d346d3.json"; R = load(n)["runs"]
    def step(label, w):
        v = [r["decode_step_ms"] for i in (1, 2) for r in R[f"{label}_{i}"]["results"] if r.get("width") == w and "decode_step_ms" in r]
        return sum(v) / len(v)
    def nodes(label, w): return next(r["graph_memory_nodes"] for r in R[f"{label}_1"]["results"] if r.get("width") == w and "graph_memory_nodes" in r)
    rows = [[f"CB W {w}", f"{step('cb_plain', w):.2f}", f"{step('cb_arena', w):.2f}", times(step("cb_plain", w) / step("cb_arena", w), 3), f"{nodes('cb_plain', w)} → {nodes('cb_arena', w)}"] for w in (16, 64)]
    cdb = {k: next(r for r in R[k]["results"] if r["mode"] == "cdb-refill") for k in ("cdb_plain", "cdb_arena")}
    V.update(arena_table=table(["launch", "plain step ms", "arena step ms", "plain ÷ arena", "memory nodes in its graphs"], rows), arena_data=data(n, date=False), arena_cmds=cmds(load(n)["commands"]),
             arena_cdb_plain=pct(cdb["cdb_plain"]["fraction_of_prefill_adjusted_bound"]), arena_cdb=pct(cdb["cdb_arena"]["fraction_of_prefill_adjusted_bound"]),
             arena_core_plain=pct(cdb["cdb_plain"]["stages"]["core"]["fraction_of_roofline"]), arena_core=pct(cdb["cdb_arena"]["stages"]["core"]["fraction_of_roofline"]))
    # Huginn: plain body, arena, arena before its norms were fused in pairs (two rounds each).
    h = "arena/h100_huginn_ab_945d968.json"; H = load(h)["runs"]
    def hrun(label, w, key): return [r[key] for i in (1, 2) for r in H[f"huginn_{label}_{i}"]["results"] if r.get("width") == w and key in r]
    def hstep(label, w): v = hrun(label, w, "decode_step_ms"); return sum(v) / len(v)
    hrows = [[f"CB W {w}", f"{hstep('plain', w):.2f}", f"{hstep('arena_old', w):.2f}", f"{hstep('arena', w):.2f}",
              times(hstep("plain", w) / hstep("arena", w), 3), times(hstep("arena_old", w) / hstep("arena", w), 3),
              f"{hrun('arena_old', w, 'graph_kernel_nodes')[0]} → {hrun('arena', w, 'graph_kernel_nodes')[0]}",
              f"{hrun('plain', w, 'graph_memory_nodes')[0]} → {hrun('arena', w, 'graph_memory_nodes')[0]}"] for w in (16, 64)]
    spread = max(abs(a - b) / max(a, b) for lab in ("plain", "arena", "arena_old") for w in (16, 64) for a, b in [hrun(lab, w, "decode_step_ms")])
    V.update(arena_huginn_table=table(["launch", "plain step ms", "arena ms, norms apart", "arena ms, norms paired", "plain ÷ arena", "pairing's gain", "kernel nodes (pairing)", "memory nodes (arena)"], hrows),
             arena_huginn_spread=pct(spread), arena_huginn_memory=str(hrun("arena", 16, "graph_memory_nodes")[0]), arena_huginn_data=data(h, date=False), arena_huginn_cmds=cmds(load(h)["commands"]))
    w = "arena/h200_huginn_gemm_workspace_39be911.json"; W = load(w)["runs"]
    at = lambda k, width, f: next(r[f] for r in W[k]["results"] if r["width"] == width)
    V.update(arena_ws_gpu=load(w)["gpu"],
             arena_ws_nodes="; ".join(f"W {x}: {at('huginn_old_1', x, 'graph_memory_nodes')} → {at('huginn_new_1', x, 'graph_memory_nodes')}" for x in (16, 64)),
             arena_ws_steps="; ".join(f"W {x}: {at('huginn_old_1', x, 'decode_step_ms'):.2f} → {at('huginn_new_1', x, 'decode_step_ms'):.2f}" for x in (16, 64)),
             arena_ws_data=data(w, date=False))
    # The diffusion step: how much of a denoise launch is kernel time.
    d = "arena/h100_sdar_kernel_share_512f029.json"; D = load(d)
    clean = by(D["clean"]["results"], "mode", "batch")
    drows, shares = [], []
    for b in (32, 256):
        for m in ("baseline", "focus"):
            k = D["kernel_time"][f"{m}_{b}"]
            launch = clean[(m, b)]["launch_ms"]
            if not k["kernels"]:
                drows.append([f"B {b}", m, f"{launch:.1f}", "— (no launch profiled)", "—"]); continue
            shares.append(k["kernel_ms"] / launch)
            drows.append([f"B {b}", m, f"{launch:.1f}", f"{k['kernel_ms']:.1f} ({k['kernels']} kernels)", pct(k["kernel_ms"] / launch)])
    V.update(arena_diffusion_table=table(["batch", "mode", "launch ms (clean run)", "kernel ms in one launch (ncu)", "kernel time ÷ launch"], drows),
             arena_diffusion_share=span(shares, d=0), arena_diffusion_idle=pct(1 - min(shares), d=0), arena_diffusion_data=data(d, date=False), arena_diffusion_cmds=cmds([D["commands"][0]] + [D["ncu_flags"] + " " + c.replace("/work/main/.device/", ".device/") for c in D["commands"][1:]]))


# ---- plots: three shapes cover every figure (matplotlib, SVG without a date) ----
def fig(title, w=8, h=3.8):
    f, ax = plt.subplots(figsize=(w, h)); ax.set_title("\n".join(textwrap.wrap(title, 120)), fontsize=8); ax.grid(True, alpha=0.3); return f, ax
def bars(labels, series, ylabel, d):
    f, ax = fig(f"{d['model']} — {d['gpu']}, commit {d['commit']}", max(8, len(labels) * 0.55 * len(series)))
    k = len(series)
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([j + (i - (k - 1) / 2) * 0.8 / k for j in range(len(labels))], ys, width=0.8 / k, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center")
    ax.set_ylabel(ylabel); ax.legend(fontsize=7); return f
def speedups(n):
    d = load(n); R = d["results"]; f, ax = fig(f"{d['model']} — {d['gpu']}, commit {d['commit']}: × over CB (solid) and the FLOP bound S (dashed)")
    keys = sorted({(r["mode"], bool(r.get("overlap")), r["target_mean_depth"], coda_rel(r) if "min_coda_batch_size" in r else "", r.get("coda_reserve", 0) > 0) for r in R if r["mode"] != "cb"}, key=str)
    for k in keys:
        pts = sorted((r for r in R if r["mode"] != "cb" and (r["mode"], bool(r.get("overlap")), r["target_mean_depth"], coda_rel(r) if "min_coda_batch_size" in r else "", r.get("coda_reserve", 0) > 0) == k), key=lambda r: r["width"])
        line, = ax.plot([r["width"] for r in pts], [r["speedup_vs_cb"] for r in pts], "o-", label=f"{k[0]}{' + overlap' if k[1] else ''}, d̄ {k[2]:g}" + (f", coda {k[3]}{' + reserve' if k[4] else ''}" if k[3] not in ("", "1") else ""))
        ax.plot([r["width"] for r in pts], [r["flop_bound"] for r in pts], "--", color=line.get_color(), lw=0.8)
    ax.set_xscale("log", base=2); ax.set_xticks(sorted({r["width"] for r in R}), [str(w) for w in sorted({r["width"] for r in R})])
    ax.axhline(1, color="grey", lw=0.8); ax.set_xlabel("width W"); ax.set_ylabel("tokens/s ÷ CB"); ax.legend(fontsize=6); return f
def modes(rows, d):
    f, ax = fig(f"{d['model']} — {d['gpu']}, commit {d['commit']}")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", label=mode)
    Bs = sorted({r["batch"] for r in rows}); ax.set_xscale("log", base=2); ax.set_xticks(Bs, [str(b) for b in Bs]); ax.set_xlabel("batch B (max_num_seqs)"); ax.set_ylabel("generated tokens/s"); ax.legend(fontsize=7); return f


def main():
    global plt
    for section in (looped, huginn, long_prompts, diffusion, gates, serve, live, fp8, fp8_h100, fp8_rows, fp8_layers, gemm_layers, roofline_breakdown, arena, h100, did_not_pay):
        section()
    gpus = lambda h: " / ".join(sorted({d["gpu"] for n, d in _cache.items() if n.startswith("h100/") == h}))
    V.update(gpus=gpus(False), h100_gpus=gpus(True))
    text = string.Template((ROOT / "tools" / "bench_report.md").read_text()).substitute(V)
    missing = [p for p in re.findall(r"\]\(([^)#:]+)\)", text) if not p.endswith(".svg") and not (DOC.parent / p).exists()]
    if missing:
        sys.exit(f"bench_report.py: linked files missing: {missing}")
    if "--no-plots" not in sys.argv:
        import matplotlib
        matplotlib.use("Agg"); matplotlib.rcParams["svg.hashsalt"] = "ponder"
        import matplotlib.pyplot as plt
        for stem, make in PLOTS:
            f = make(); f.tight_layout(); f.savefig(BENCH / f"{stem}.svg", metadata={"Date": None}); plt.close(f)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)} ({text.count(chr(10))} lines, {len(PLOTS)} plots)")


if __name__ == "__main__":
    main()
