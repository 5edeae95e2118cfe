#!/usr/bin/env python3
"""Reads `tools/ring_probe.cu compare` output (a device call's summary.txt, any number of runs at
16 and 64 rows) and prints, per row count, each graph's step time (mean of the rounds and runs,
with the spread) and the fused ring's saving over the library's chain against what the milestone
needs (BENCHMARKS, session 32): 0.88 ms a step at W 16 for 65 %, 0.48 ms at W 64 for 65 % and
0.96 ms for 1.3x the issue's PyTorch step. With --json, also writes the figures.

    python3 tools/fused_norm_table.py summary.txt [--json out.json]
"""
import argparse, json, re, statistics

HEADER = re.compile(r"a step's chain, 96 layer applications at (\d+) rows")
ROUND = re.compile(r"round (\d+)\s+(.+?)\s+([\d.]+) ms\s+([\d.]+) us a layer")
LIBRARY, FUSED = "cuBLAS + library norms + SiLU·mul", "ring + PDL, 16 stages, norms folded"
# Savings a step (ms) each width needs from the fused ring, and what for.
NEEDED = {16: [(0.88, "65 % at W 16")], 64: [(0.48, "65 % at W 64"), (0.96, "1.3x the PyTorch step at W 64")]}


def parse(text):
    """{rows: {graph name: [ms, ...]}} from every compare block in `text`."""
    runs, rows = {}, None
    for line in text.splitlines():
        if m := HEADER.search(line):
            rows = int(m.group(1))
        elif rows is not None and (m := ROUND.match(line.strip())):
            runs.setdefault(rows, {}).setdefault(m.group(2), []).append(float(m.group(3)))
    return runs


def saving(graphs, attention):
    """Library chain minus fused ring, mean ms, for the pair with or without attention."""
    suffix = " + attention" if attention else ""
    lib = next((v for k, v in graphs.items() if k.startswith(LIBRARY) and k.endswith(" + attention") == attention), None)
    fused = graphs.get(FUSED + suffix)
    return None if lib is None or fused is None else statistics.mean(lib) - statistics.mean(fused)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("summary")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = parse(open(args.summary, encoding="utf-8").read())
    if not runs:
        raise SystemExit("no compare output found")
    out = {}
    for rows, graphs in sorted(runs.items()):
        print(f"\n| {rows} rows: graph | step ms (mean of {max(len(v) for v in graphs.values())}) | spread | µs a layer |")
        print("|---|---|---|---|")
        for name, ms in graphs.items():
            mean = statistics.mean(ms)
            print(f"| {name} | {mean:.3f} | {min(ms):.3f}–{max(ms):.3f} | {mean * 1e3 / 96:.2f} |")
        verdicts = []
        for attention in (False, True):
            d = saving(graphs, attention)
            if d is None:
                continue
            for need, what in NEEDED.get(rows, []):
                verdicts.append({"attention": attention, "saving_ms": d, "needed_ms": need, "for": what, "met": d >= need})
                print(f"{'with' if attention else 'without'} attention: the fused ring saves {d:.3f} ms a step; "
                      f"{what} needs {need:.2f} — {'enough' if d >= need else 'not enough'}")
        out[rows] = {"graphs": {k: {"ms": v, "mean_ms": statistics.mean(v)} for k, v in graphs.items()}, "verdicts": verdicts}
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
