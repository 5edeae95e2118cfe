#!/usr/bin/env python3
"""Merges raw `bench_looped --suite cdb` JSON files (one per device run) into one document.

    python3 tools/merge_bench.py --date 2026-11-29 --out docs/bench/looped_cdb.json \
        docs/bench/raw-2026-11-29/cdb_{16_64,32_128,256,512,noexit}.json
    python3 tools/merge_bench.py --date 2026-11-29 --out docs/bench/looped_huginn.json \
        docs/bench/raw-2026-11-29/huginn_16_64.json

Top level: gpu, commit, date, model, layout, f0_over_fr, weight_bytes_per_decode_step, the exact
`commands` (one per raw file, in input order), `sources` (file, command, measured copy
bandwidth) and `notes`. `results` keeps every row of every file unchanged (all fields, both
overlap settings, all min-coda sizes) and adds `source`: the raw file the row came from. The
inputs must agree on GPU, commit, model, layout and F0/Fr — or, with `--mixed-commits`, on all
but the commit: `commit` then lists every input's commit, and each row and source carries its own.
"""
import argparse, json, pathlib

AGREE = ["gpu", "commit", "model", "layout", "f0_over_fr", "weight_bytes_per_decode_step", "suite", "workload", "env"]


def field(d, k):
    """A top-level field; files from before `env` was recorded ran with no PONDER_* variables."""
    return (d.get(k) or {}) if k == "env" else d.get(k)


def lengths(w):
    """The workload's length distributions (files before the `workload` field used the defaults)."""
    w = w or {"prompt": {"median": 128, "sigma": 0.9, "min": 8, "max": 512}, "output": {"median": 160, "sigma": 0.7, "min": 8, "max": 256}}
    f = lambda k: f"{k} ~ lognormal(median {w[k]['median']:g}, sigma {w[k]['sigma']:g}) clipped to {w[k]['min']}..{w[k]['max']}"
    return f"{f('prompt')}, {f('output')}"


def merge(paths, date, mixed_commits=False):
    docs = [(p, json.loads(p.read_text())) for p in paths]
    first = docs[0][1]
    agree = [k for k in AGREE if not (mixed_commits and k == "commit")]
    for p, d in docs[1:]:
        for k in agree:
            if field(d, k) != field(first, k):
                raise SystemExit(f"{p.name}: {k} = {field(d, k)!r} differs from {docs[0][0].name}: {field(first, k)!r}")
    out = {k: first[k] for k in AGREE if k in first}
    commits = list(dict.fromkeys(d["commit"] for _, d in docs))
    out["commit"] = ", ".join(commits)
    out["date"] = date
    out["commands"] = [d["command"] for _, d in docs]
    # The schema names one `command`: the single run's, or every run's, one per line.
    out["command"] = "\n".join(out["commands"])
    out["sources"] = [
        {"file": f"{p.parent.name}/{p.name}", "commit": d["commit"], "command": d["command"], "copy_bandwidth_gb_s": d.get("copy_bandwidth_gb_s")}
        for p, d in docs
    ]
    whole = all(r["tokens_per_s"] == r.get("tokens_per_s_whole_run") for _, d in docs for r in d["results"])
    out["notes"] = [
        "tokens_per_s is offline throughput; cb rows at a second mean depth are the same CB run "
        "copied (CB runs full depth whatever the exit distribution)",
        "workload per width: requests_per_width x W requests, " + lengths(first.get("workload")) + ", seed 42 + W "
        "(examples/bench_looped/workload.rs); --new-tokens / --prompt-len do not apply to suite cdb",
    ]
    if whole:
        out["notes"].append(
            "in every row the steady-state window (after W completions, up to the last admission) "
            "was shorter than 20 % of the run, so tokens_per_s is the whole-run throughput "
            "(ramp-up and drain included)"
        )
    out["results"] = [dict(r, source=p.name, commit=d["commit"]) for p, d in docs for r in d["results"]]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--mixed-commits", action="store_true", help="inputs may come from different commits")
    ap.add_argument("raw", nargs="+")
    a = ap.parse_args()
    doc = merge([pathlib.Path(p) for p in a.raw], a.date, a.mixed_commits)
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}: {len(doc['results'])} rows from {len(a.raw)} files")


if __name__ == "__main__":
    main()
