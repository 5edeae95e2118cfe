#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from an `ncu` source-page CSV.

    ncu --section WarpStateStats --section SourceCounters -o rep … ; \
    ncu -i rep.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 tools/sass_stalls.py sass.csv[.xz] [--top 12]

Prints, for every kernel in the file, the share of warp-state samples by stall reason and the
instructions with the most samples (with their top two reasons). A consumer warp spinning on an
mbarrier shows as a `BRA` back to `SYNCS…TRYWAIT` with `long_sb` samples; a wgmma wait as
`WARPGROUP.DEPBAR` with `barrier`; a full store queue as `lg` on `STG`.
"""
import argparse
import csv
import io
import lzma


def kernels(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        text = f.read()
    found, name, header = {}, None, None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = row[1], None
            found.setdefault(name, {})
        elif row[0] == "Address":
            header = row
        elif header and name:
            d = dict(zip(header, row))
            found[name][d["Address"]] = d  # a kernel profiled twice lists its rows twice
    return found


def samples(d, key="Warp Stall Sampling (All Samples)"):
    return int(d.get(key) or 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for name, rows in kernels(args.csv).items():
        ins = sorted(rows.values(), key=lambda d: int(d["Address"], 16))
        total = sum(samples(d) for d in ins) or 1
        reasons = [c for c in ins[0] if c.startswith("stall_") and "Not Issued" not in c]
        by_reason = {c[6:]: sum(int(d[c] or 0) for d in ins) for c in reasons}
        print(f"== {name}: {len(ins)} instructions, {total} samples")
        print("   by reason: " + ", ".join(f"{r} {100 * v / total:.1f}%" for r, v in sorted(by_reason.items(), key=lambda x: -x[1]) if v >= 0.005 * total))
        for d in sorted(ins, key=lambda d: -samples(d))[: args.top]:
            top = sorted(((int(d[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
            why = ", ".join(f"{r} {v}" for v, r in top if v)
            print(f"   {100 * samples(d) / total:5.1f}%  {d['Address'][-5:]}  {d['Source'].strip()[:56]:56s} executed {d['Instructions Executed']:>9s}  {why}")


if __name__ == "__main__":
    main()
