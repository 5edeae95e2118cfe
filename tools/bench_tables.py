#!/usr/bin/env python3
"""Prints the markdown tables of docs/BENCHMARKS.md from docs/bench/*.json.

    python3 tools/bench_tables.py                      # looped_cb, looped_cdb, looped_huginn, diffusion
    python3 tools/bench_tables.py looped_cdb_eager.json
    python3 tools/bench_tables.py diffusion.json       # bench_diffusion: throughput + phase breakdown
    python3 tools/bench_tables.py focus.json           # FOCUS vs both baselines + phase-timed launches

Files whose rows carry `overlap` (bench_looped since deferred readback, merged by
tools/merge_bench.py) get the per-mean-depth tables, the no-exit check and the per-stage time
split; older files the single table they had.
"""
import json, pathlib

bench = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench"

def cb(name="looped_cb.json"):
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    print(f"| W | tokens/s | decode step ms | weight-streaming bound tokens/s | share of bound |")
    print("|---|---|---|---|---|")
    for r in d["results"]:
        print(f"| {r['width']} | {r['tokens_per_s']:.0f} | {r['decode_step_ms']:.2f} | {r['floor_tokens_per_s']:.0f} | {100*r['tokens_per_s']/r['floor_tokens_per_s']:.1f} % |")

def decode_seconds(r):
    st = r["stages"]
    return sum(v["seconds"] for k, v in st.items() if k != "prefill")

def cdb_old(name):
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    rows = d["results"]
    cb_rows = {r["width"]: r for r in rows if r["mode"] == "cb"}
    print("| W | d̄ | mode | tokens/s | speed-up vs CB | FLOP bound | share of bound | decode-only speed-up | prefill share of CB time | GPU idle ≤ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mode"] == "cb" and r["mean_depth"] != rows[0]["mean_depth"]:
            continue
        c = cb_rows[r["width"]]
        dec = decode_seconds(c) / decode_seconds(r)
        pre = c["stages"]["prefill"]["seconds"] / sum(v["seconds"] for v in c["stages"].values())
        sp = r["speedup_vs_cb"] or 1.0
        frac = r["fraction_of_bound"] if r["mode"] != "cb" else None
        dm = "4 (full)" if r["mode"] == "cb" else f"{r['mean_depth']:.2f}"
        bound = "—" if r["mode"] == "cb" else f"{r['flop_bound']:.3f}"
        print(f"| {r['width']} | {dm} | {r['mode']} | {r['tokens_per_s']:.0f} | {sp:.3f}× | {bound} | "
              f"{'' if frac is None else f'{100*frac:.1f} %'} | {dec:.3f}× | {100*pre:.0f} % | {100*r['gpu_idle']:.0f} % |")



# ---- files with overlap rows (2026-11-29 on) ----

def pct(x):
    return f"{100 * x:.1f} %"


def coda_relative(r):
    """Min coda batch relative to the width: "1", "W/4", "W/2", "W" or the number."""
    m, w = r["min_coda_batch_size"], r["width"]
    return {1: "1", max(w // 4, 1): "W/4", max(w // 2, 1): "W/2", w: "W"}.get(m, str(m))


def coda_size(r):
    """Min coda batch as a number and, when it is a fraction of W, which one."""
    rel = coda_relative(r)
    return rel if rel[0] != "W" else f"{r['min_coda_batch_size']} ({rel})"


def mode_label(r, coda=False):
    if r["mode"] == "cb":
        return "cb"
    s = r["mode"] + (" + overlap" if r.get("overlap") else "")
    if coda:
        s += f", coda ≥ {r['min_coda_batch_size']}"
        if r.get("coda_reserve"):
            s += f", reserve {r['coda_reserve']}"
    return s


def same_run_cb(rows, r):
    """The CB row of r's width from r's own run (its raw file), else any CB row of that width."""
    cbs = [c for c in rows if c["mode"] == "cb" and c["width"] == r["width"]]
    return next((c for c in cbs if c.get("source") == r.get("source")), cbs[0] if cbs else None)


def generated_tokens(r):
    st = r["stages"]
    return sum(v["rows"] for k, v in st.items() if k in ("prefill", "decode", "coda"))


def header(d, what, rows=None):
    """HTML comment (file, GPU, commit) and a visible caption: GPU, commit, date and which of
    the file's `commands` (numbered from 1, as in the doc's command block) produced the rows."""
    print(f"<!-- {what}: {d['gpu']}, commit {d['commit']}, {d.get('date', '')} -->")
    srcs = d.get("sources", [])
    used = {r.get("source") for r in (rows if rows is not None else d["results"])}
    idx = [i + 1 for i, s in enumerate(srcs) if s["file"].split("/")[-1] in used]
    cmd = ", ".join(f"[{i}]" for i in idx)
    print(f"*{d['gpu']}, commit `{d['commit']}`, {d.get('date', '')}; command{'s' if len(idx) > 1 else ''} {cmd} above.*")
    print()


def noexit_refs(rows):
    """(refill+overlap tok/s at d̄ = 4, CB tok/s of that same run) by width."""
    ref = {}
    for r in rows:
        if r["mode"] == "cdb-refill" and r.get("overlap") and r["target_mean_depth"] == 4.0:
            cb_same = next(c for c in rows if c["mode"] == "cb" and c["width"] == r["width"] and c["source"] == r["source"])
            ref[r["width"]] = (r["tokens_per_s"], cb_same["tokens_per_s"])
    return ref


def strict(r, rows, ref):
    """Speed-up over depth-refill + overlap at no exit (direct), the same normalised by each
    run's own CB (the two runs are separate processes), and the fractions of the bound."""
    if r["mode"] == "cb" or not r.get("overlap") or r["width"] not in ref:
        return None
    t4, cb4 = ref[r["width"]]
    cb_here = next(c for c in rows if c["mode"] == "cb" and c["width"] == r["width"] and c["source"] == r["source"])
    direct = r["tokens_per_s"] / t4
    normed = (r["tokens_per_s"] / cb_here["tokens_per_s"]) / (t4 / cb4)
    return direct, normed, direct / r["flop_bound"], normed / r["flop_bound"]


def cdb_depth_tables(d, name):
    rows = d["results"]
    ref = noexit_refs(rows)
    depths = sorted({r["target_mean_depth"] for r in rows if r["target_mean_depth"] < 4.0})
    order = {("cb", False): 0, ("cdb-no-refill", False): 1, ("cdb-no-refill", True): 2, ("cdb-refill", False): 3, ("cdb-refill", True): 4}
    for t in depths:
        header(d, f"{name}, replayed mean depth {t}",
               [r for r in rows if r["target_mean_depth"] == t or (r["target_mean_depth"] == 4.0 and r["width"] in ref)])
        idle = "GPU idle" if any(r.get("gpu_idle_exact") for r in rows) else "GPU idle ≤"
        # The strict columns need a no-exit (d̄ = 4) run in the same file.
        strict_cols = "× over refill + overlap at d̄ = 4 | % of bound, strict | " if ref else ""
        print(f"| W | mode | d̄ | tokens/s | × over CB | FLOP bound | % of bound | {strict_cols}{idle} |")
        print("|---|---|---|---|---|---|---|---|---|---|" if ref else "|---|---|---|---|---|---|---|---|")
        sel = sorted((r for r in rows if r["target_mean_depth"] == t), key=lambda r: (r["width"], order[(r["mode"], bool(r.get("overlap")))]))
        for r in sel:
            cb = r["mode"] == "cb"
            s = strict(r, rows, ref)
            sx = "" if s is None else f"{s[0]:.3f}× ({s[1]:.3f}×)"
            sf = "" if s is None else f"{pct(s[2])} ({pct(s[3])})"
            frac = "—" if cb else pct(r["fraction_of_bound"])
            bold = r["mode"] == "cdb-refill" and r.get("overlap")
            b = (lambda x: f"**{x}**") if bold else (lambda x: x)
            dm = "4 (full)" if cb else f"{r['mean_depth']:.2f}"
            bound = "—" if cb else f"{r['flop_bound']:.3f}"
            extra = f"{sx} | {sf} | " if ref else ""
            print(f"| {r['width']} | {mode_label(r)} | {dm} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup_vs_cb']:.3f}× | {bound} | {b(frac)} | {extra}{pct(r['gpu_idle'])} |")
        print()


def cdb_noexit_table(d, name):
    rows = [r for r in d["results"] if r["target_mean_depth"] == 4.0]
    if not rows:
        return
    header(d, f"{name}, mean depth 4.0 (no early exit)", rows)
    print("| W | mode | tokens/s | × over CB (same run) | GPU idle ≤ |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["width"], r["mode"], bool(r.get("overlap")))):
        print(f"| {r['width']} | {mode_label(r)} | {r['tokens_per_s']:.0f} | {r['speedup_vs_cb']:.3f}× | {pct(r['gpu_idle'])} |")
    print()


def stage_table(d, name, picks, coda=False, full_depth=4):
    """picks: (width, target mean depth or None for any, mode, overlap, min coda or None)."""
    picked = [next(r for r in d["results"] if r["width"] == w and (t is None or r["target_mean_depth"] == t) and r["mode"] == mode
                   and bool(r.get("overlap")) == ov and (mc is None or r["min_coda_batch_size"] == mc))
              for w, t, mode, ov, mc in picks]
    header(d, f"{name}, per-stage launch time", picked)
    print("| W | d̄ | mode | stage | launches | launch s | device wait s | not waiting s | not waiting ms / launch | share of wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in picked:
        w, mode = r["width"], r["mode"]
        wall = generated_tokens(r) / r["tokens_per_s"]
        tot_s = tot_w = 0.0
        label = mode_label(r, coda)
        dm = f"{full_depth} (full)" if mode == "cb" else f"{r['mean_depth']:.2f}"
        for k in ("prefill", "decode", "core", "coda"):
            if k not in r["stages"]:
                continue
            v = r["stages"][k]
            host = v["seconds"] - v["device_wait_s"]
            tot_s += v["seconds"]
            tot_w += v["device_wait_s"]
            print(f"| {w} | {dm} | {label} | {k} | {v['launches']} | {v['seconds']:.2f} | {v['device_wait_s']:.2f} | {host:.2f} | {1e3 * host / v['launches']:.2f} | {pct(v['seconds'] / wall)} |")
        print(f"| {w} | {dm} | {label} | outside launches (scheduler, events) | | {wall - tot_s:.2f} | | {wall - tot_s:.2f} | | {pct((wall - tot_s) / wall)} |")
        print(f"| {w} | {dm} | {label} | **whole run** | | **{wall:.2f}** | **{tot_w:.2f}** | **{wall - tot_w:.2f}** | | device wait {pct(tot_w / wall)} of wall |")
    print()


def gap_table(d, name):
    """fraction of bound = (device-wait ratio CB ÷ CDB) ÷ bound × (CDB device-wait share of wall ÷ CB's).
    An identity once device wait is taken as each run's device time (it is a lower bound on it)."""
    rows = d["results"]
    wait = lambda r: sum(v["device_wait_s"] for v in r["stages"].values())
    wall = lambda r: generated_tokens(r) / r["tokens_per_s"]
    header(d, f"{name}, depth-refill + overlap: device side × host side", [r for r in rows if r["target_mean_depth"] < 4.0])
    print("| W | d̄ | % of bound | device wait CB ÷ CDB | … as % of bound (device side) | device wait share of wall, CB | … CDB | host-side factor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted((r for r in rows if r["mode"] == "cdb-refill" and r.get("overlap") and r["target_mean_depth"] < 4.0),
                    key=lambda r: (r["target_mean_depth"], r["width"])):
        cb = next(c for c in rows if c["mode"] == "cb" and c["width"] == r["width"] and c["source"] == r["source"])
        dev = wait(cb) / wait(r)
        s_cb, s_cdb = wait(cb) / wall(cb), wait(r) / wall(r)
        print(f"| {r['width']} | {r['mean_depth']:.2f} | {pct(r['fraction_of_bound'])} | {dev:.3f}× | {pct(dev / r['flop_bound'])} | "
              f"{pct(s_cb)} | {pct(s_cdb)} | {s_cdb / s_cb:.3f}× |")
    print()


def prefill_adjusted_bound(cb, flop_bound):
    """The paper's realistic ceiling from a CB row with device spans: CB's device time with its
    decode divided by the FLOP bound and its prefill unchanged (no prompt token exits early).
    None without spans."""
    st = cb.get("stages", {})
    p, d = st.get("prefill", {}).get("device_s"), st.get("decode", {}).get("device_s")
    if p is None or d is None:
        return None
    return (p + d) / (p + d / flop_bound)


def device_table(d, name, full_depth=4, coda=False):
    """Runs with device spans (`--time-device`): where each mode's device time goes, per generated
    token, and the speed-up the bound allows once the full-depth prefill is counted.

    decode: CB's decode launches, CDB's core + coda. Decode-only ratio = CB decode µs/token ÷ CDB
    decode µs/token (what the FLOP bound S describes). Prefill-inclusive bound: CB's device time
    with its decode divided by S, prefill unchanged (no token of a prompt can exit early)."""
    rows = [r for r in d["results"] if all(v.get("device_s") is not None for v in r["stages"].values())]
    if not rows:
        return
    header(d, f"{name}, device time per generated token (stream-event spans)", rows)
    print("| W | target d̄ | mode | prefill µs/token | decode µs/token (core + coda) | decode rows / launch | decode ratio CB ÷ mode | … % of S | prefill share of device | bound with prefill | % of that | GPU idle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {"cb": 0, "cdb-no-refill": 1, "cdb-refill": 2}
    dev = lambda r, ks: sum(r["stages"][k]["device_s"] for k in ks if k in r["stages"])
    for r in sorted(rows, key=lambda r: (r["target_mean_depth"], r["width"], order[r["mode"]], r["min_coda_batch_size"])):
        cb = same_run_cb(d["results"], r)
        if cb is None or (r["mode"] == "cb" and r["target_mean_depth"] != min(x["target_mean_depth"] for x in rows if x.get("source") == r.get("source"))):
            continue
        tokens = generated_tokens(r)
        pre, dec = dev(r, ["prefill"]), dev(r, ["decode", "core", "coda"])
        cb_pre, cb_dec = dev(cb, ["prefill"]), dev(cb, ["decode"])
        st = r["stages"]
        main = st.get("decode") or st.get("core")
        per_launch = main["rows"] / main["launches"]
        label = mode_label(r, coda)
        if r["mode"] == "cb":
            print(f"| {r['width']} | — | {label} | {1e6 * pre / tokens:.1f} | {1e6 * dec / tokens:.1f} | {per_launch:.0f} | — | — | {pct(pre / (pre + dec))} | — | — | {pct(r['gpu_idle'])} |")
            continue
        # Per generated token: runs measured over windows of different lengths differ in tokens.
        ratio = (cb_dec / generated_tokens(cb)) / (dec / tokens)
        with_prefill = prefill_adjusted_bound(cb, r["flop_bound"])
        print(f"| {r['width']} | {r['target_mean_depth']:g} | {label} | {1e6 * pre / tokens:.1f} | {1e6 * dec / tokens:.1f} | {per_launch:.0f} | "
              f"{ratio:.3f}× | {pct(ratio / r['flop_bound'])} | {pct(pre / (pre + dec))} | {with_prefill:.3f}× | {pct(r['speedup_vs_cb'] / with_prefill)} | {pct(r['gpu_idle'])} |")
    print()


def huginn_table(d, name):
    rows = d["results"]
    header(d, name)
    idle = "GPU idle" if any(r.get("gpu_idle_exact") for r in rows) else "GPU idle ≤"
    reserve = any("coda_reserve" in r for r in rows)
    res_col = " resident requests ≤ |" if reserve else ""
    print(f"| W | target d̄ | mode | min coda batch |{res_col} d̄ | tokens/s | × over CB | FLOP bound | % of bound | {idle} |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if reserve else ""))
    order = {"cb": 0, "cdb-no-refill": 1, "cdb-refill": 2}
    for r in sorted(rows, key=lambda r: (r["width"], r["target_mean_depth"], order[r["mode"]], r["min_coda_batch_size"])):
        cb = r["mode"] == "cb"
        mc = "—" if cb else coda_size(r)
        res = f" {r['width'] + r.get('coda_reserve', 0)} |" if reserve else ""
        print(f"| {r['width']} | {r['target_mean_depth']:g} | {mode_label(r)} | {mc} |{res} {'16 (full)' if cb else format(r['mean_depth'], '.2f')} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup_vs_cb']:.3f}× | {'—' if cb else format(r['flop_bound'], '.3f')} | {'—' if cb else pct(r['fraction_of_bound'])} | {pct(r['gpu_idle'])} |")
    print()


def cdb(name="looped_cdb.json"):
    d = json.loads((bench / name).read_text())
    if not any("overlap" in r for r in d["results"]):
        return cdb_old(name)
    if "huginn" in d["model"].lower():
        huginn_table(d, name)
        if any(r.get("gpu_idle_exact") for r in d["results"]):
            device_table(d, name, full_depth=16, coda=True)
            return
        stage_table(d, name, [(64, 6.0, m, ov, mc) for m, ov, mc in
                              [("cb", False, None), ("cdb-no-refill", True, 1), ("cdb-refill", True, 1), ("cdb-refill", True, 16)]],
                    coda=True, full_depth=16)
        return
    cdb_depth_tables(d, name)
    cdb_noexit_table(d, name)
    if any(r.get("gpu_idle_exact") for r in d["results"]):
        # Device spans measured: they replace the host-wait estimates below.
        device_table(d, name)
        return
    gap_table(d, name)
    stage_table(d, name, [(w, 2.5, m, ov, None) for w in (128, 512) for m, ov in [("cb", False), ("cdb-refill", True)]]
                + [(256, 2.5, "cdb-refill", False, None)])


# ---- bench_diffusion (block diffusion, SDAR-8B shapes) ----

# SDAR-8B-Chat-b32 (`SdarConfig::sdar_8b_chat_b32`): the JSON does not carry the shapes.
SDAR_8B = dict(hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936)


def sdar_flops(tokens, readouts, s=SDAR_8B):
    """Matmul FLOPs of one step over `tokens` tokens reading out `readouts`: (q/k/v, o + MLP, LM head)."""
    h, hd = s["hidden"], s["head_dim"]
    qkv = 2 * tokens * h * (s["heads"] + 2 * s["kv_heads"]) * hd * s["layers"]
    o_mlp = 2 * tokens * (h * s["heads"] * hd + 3 * h * s["inter"]) * s["layers"]
    head = 2 * readouts * h * s["vocab"]
    return qkv, o_mlp, head


def diffusion(name="diffusion.json"):
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    print(f"*{d['gpu']}, commit `{d['commit']}`; command above.*")
    print()
    rows = d["results"]
    base = {r["batch"]: r for r in rows if r["mode"] == "baseline"}
    delayed = {r["batch"]: r for r in rows if r["mode"] == "baseline-delayed"}
    kept = any(r.get("kept_per_step") is not None for r in rows)  # focus rows (bench_diffusion since 80bef95)
    order = {"baseline": 0, "baseline-delayed": 1, "focus": 2}
    print("| batch B | mode | tokens/s (window) | tokens/s (whole run) | × over baseline |" + (" × over baseline-delayed |" if kept else "")
          + " tokens through the network per request-step |" + (" kept past layer 1 per request-step |" if kept else "")
          + " tokens decoded per request-step | window steps | ≈ ms per step (B × decoded ÷ tokens/s) |")
    print("|---|---|---|---|---|" + ("---|---|" if kept else "") + "---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["batch"], order.get(r["mode"], 9))):
        ratio = lambda ref: f"{r['tokens_per_s'] / ref[r['batch']]['tokens_per_s']:.2f}×" if r["batch"] in ref else ""
        ms = 1e3 * r["batch"] * r["decoded_per_step"] / r["tokens_per_s"]
        k = "" if r.get("kept_per_step") is None else f"{r['kept_per_step']:.1f}"
        vs_delayed = ratio(delayed) if r["mode"] == "focus" else ""
        print(f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_whole_run']:.0f} | {ratio(base)} |"
              + (f" {vs_delayed} |" if kept else "") + f" {r['tokens_per_step']:.1f} of {r['block']} |" + (f" {k} |" if kept else "")
              + f" {r['decoded_per_step']:.2f} (trace mean {r['mean_unmask']:g}) | {r['window_steps']} | {ms:.0f} |")
    print()
    bd = sorted(d.get("breakdown") or [], key=lambda r: r["batch"])
    if not bd:
        return
    print(f"<!-- {name}, phase breakdown: {d['gpu']}, commit {d['commit']} -->")
    print(f"*{d['gpu']}, commit `{d['commit']}`; command above (`--breakdown`).*")
    print()
    # Since e18a0d2 the q/k norm, RoPE and K/V write are one fused op, timed with the QKV matmul.
    fused = "qkv_norm_rope_kv_write_ms" in bd[0]
    qkv_key = "qkv_norm_rope_kv_write_ms" if fused else "qkv_norm_rope_ms"
    phases = [(qkv_key, "QKV + q/k norm + RoPE + K/V write" if fused else "QKV + q/k norm + RoPE")]
    phases += [] if fused else [("kv_write_ms", "K/V write")]
    phases += [("attention_ms", "paged attention"), ("o_proj_mlp_ms", "o_proj + MLP"), ("lm_head_readout_ms", "LM head + readout"),
               ("embed_rope_ms", "embed + RoPE angles")]
    print("| B | tokens (prefix) | " + " | ".join(f"{p}, ms (share)" for _, p in phases) + " | total ms | µs per token |")
    print("|---|---|" + "---|" * len(phases) + "---|---|")
    for r in bd:
        cells = [f"{r[k]:.1f} ({100 * r[k] / r['total_ms']:.0f} %)" for k, _ in phases]
        print(f"| {r['batch']} | {r['tokens']} ({r['prefix']}) | " + " | ".join(cells) + f" | **{r['total_ms']:.1f}** | {1e3 * r['total_ms'] / r['tokens']:.1f} |")
    print()
    # Effective matmul rates: the breakdown reads out every position of each row's block but the first 3.
    print(f"| B | {phases[0][1]}, TFLOP/s | o_proj + MLP, TFLOP/s | LM head + readout, TFLOP/s (readouts) |")
    print("|---|---|---|---|")
    for r in bd:
        block = r["tokens"] // r["batch"]
        readouts = r["batch"] * (block - 3)
        qkv, o_mlp, head = sdar_flops(r["tokens"], readouts)
        print(f"| {r['batch']} | {qkv / r[qkv_key] / 1e9:.0f} | {o_mlp / r['o_proj_mlp_ms'] / 1e9:.0f} | "
              f"{head / r['lm_head_readout_ms'] / 1e9:.0f} ({readouts}) |")
    print()


PHASE_ORDER = ["embed + rope", "layers", "layers 0-1 + importance", "selection", "compaction", "layers past 1", "lm head + readout"]


def focus(name="focus.json"):
    """FOCUS against both baselines, then the phase-timed runs (ms per launch by phase)."""
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    print(f"*{d['gpu']}, commit `{d['commit']}`; command above.*")
    print()
    rows = d["results"] + d.get("baseline_delayed", [])  # results: baseline and focus (the issue's schema)
    by = {(r["batch"], r["mode"]): r for r in rows}
    print("| batch B | baseline tokens/s | baseline-delayed tokens/s | FOCUS tokens/s | FOCUS × over baseline | FOCUS × over baseline-delayed "
          "| tokens through layers 0–1 per request-step | kept past layer 1 (FOCUS) | decoded per request-step, baseline / FOCUS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in sorted({r["batch"] for r in rows}):
        base, dl, fo = by[(b, "baseline")], by[(b, "baseline-delayed")], by[(b, "focus")]
        print(f"| {b} | {base['tokens_per_s']:.0f} | {dl['tokens_per_s']:.0f} | **{fo['tokens_per_s']:.0f}** | **{fo['speedup_vs_baseline']:.2f}×** "
              f"| {fo['speedup_vs_delayed']:.2f}× | {fo['tokens_per_step']:.1f} (delayed: {dl['tokens_per_step']:.1f}; baseline 32) "
              f"| {fo['kept_per_step']:.1f} | {base['decoded_per_step']:.2f} / {fo['decoded_per_step']:.2f} |")
    print()
    ph = d.get("phases")
    if not ph:
        return
    print(f"<!-- {name}, phases: {d['gpu']}, commit {ph['commit']} -->")
    print(f"*{d['gpu']}, commit `{ph['commit']}`: `{ph['command']}`.*")
    print()
    names = [p for p in PHASE_ORDER if any(p in r["phases_ms_per_launch"] for r in ph["results"])]
    print("| B | mode | tokens/s (phase-timed) | launch ms | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for r in ph["results"]:
        cells = [f"{r['phases_ms_per_launch'][p]:.2f}" if p in r["phases_ms_per_launch"] else "–" for p in names]
        print(f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['launch_ms']:.1f} | " + " | ".join(cells) + " |")
    print()


def llada2(name="llada2.json"):
    """LLaDA2.0-mini: every mode's tokens/s, its fraction of the compute bound, FOCUS's ratios."""
    d = json.loads((bench / name).read_text())
    print(f"<!-- {name}: {d['gpu']}, commit {d['commit']} -->")
    print(f"*{d['gpu']}, commit `{d['commit']}`: `{d['command']}`.*")
    print()
    by = {(r["batch"], r["mode"]): r for r in d["results"]}
    print("| batch B | baseline tok/s (of compute bound) | baseline-delayed tok/s (of bound) | FOCUS tok/s | FOCUS × over baseline | FOCUS × over delayed "
          "| positions run per request-step: baseline / delayed / FOCUS layers 0–1 → kept | launch ms: baseline / delayed / FOCUS |")
    print("|---|---|---|---|---|---|---|---|")
    for b in sorted({r["batch"] for r in d["results"]}):
        base, dl, fo = by[(b, "baseline")], by[(b, "baseline-delayed")], by[(b, "focus")]
        frac = lambda r: f"{r['tokens_per_s']:.0f} ({100 * r['fraction_of_compute_bound']:.1f} %)"
        print(f"| {b} | {frac(base)} | {frac(dl)} | **{fo['tokens_per_s']:.0f}** | {fo['speedup_vs_baseline']:.2f}× | **{fo['speedup_vs_delayed']:.2f}×** "
              f"| {base['tokens_per_step']:.0f} / {dl['tokens_per_step']:.1f} / {fo['tokens_per_step']:.1f} → {fo['kept_per_step']:.1f} "
              f"| {base['launch_ms']:.1f} / {dl['launch_ms']:.1f} / {fo['launch_ms']:.1f} |")
    print()


def memory_table(name):
    """Peak device memory per row, for runs that recorded it (bench_* after 2026-11-29g)."""
    d = json.loads((bench / name).read_text())
    rows = [r for r in d["results"] if r.get("peak_device_memory_gb") is not None]
    if not rows:
        return
    size = "batch" if "batch" in rows[0] else "width"
    print(f"<!-- {name}, peak device memory: {d['gpu']}, commit {d['commit']} -->")
    print("| " + ("B" if size == "batch" else "W") + " | mode | peak device memory, GB | of it: memory pool | CUDA graphs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[size]} | {r['mode']} | {r['peak_device_memory_gb']:.1f} | {r['peak_device_memory_pool_gb']:.1f} | {r['peak_device_memory_graphs_gb']:.1f} |")
    print()


if __name__ == "__main__":
    import sys
    for name in sys.argv[1:] or ["looped_cb.json", "looped_cdb.json", "looped_huginn.json", "diffusion.json", "focus.json"]:
        if name.startswith("diffusion"):
            diffusion(name)
        elif name.startswith("focus"):
            focus(name)
        elif name.startswith("llada2"):
            llada2(name)
        else:
            (cb if name.startswith("looped_cb") else cdb)(name)
        print()
        memory_table(name)
