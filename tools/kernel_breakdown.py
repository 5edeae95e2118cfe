#!/usr/bin/env python3
"""Groups the kernels of one profiled launch (ncu CSV, metric gpu__time_duration.sum; plain or
.xz) by family, and where the launch repeats a kernel sequence (a looped step's layer
applications) by position in it — GEMMs told apart by shape and role, though cuBLAS gives o_proj
and down one kernel name — and prints markdown tables and a JSON summary.

    ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum --csv \\
        .device/bench_looped --suite cb --widths 64 --prompt-len 256 --new-tokens 16 --repeats 1 --profile-step > step.csv
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        .device/bench_diffusion --model llada2-mini --batches 256 --modes baseline \\
        --requests-per-batch 1 --new-tokens 64 --profile-step > launch.csv
    python3 tools/kernel_breakdown.py step.csv [--json out.json [--gpu G] [--commit C] [--command "…"]]

Without --cache-control none and --clock-control none, ncu flushes the L2 before every kernel and
locks base clocks, which inflates exactly the small kernels that read what the kernel before them
wrote; with them a step's kernels, run one at a time, take 4–14 % longer than the graph step
(W 256 / W 16 on the H200: in a graph a kernel's launch and ramp overlap the one before).
"""
import csv
import io
import json
import lzma
import re
import sys

FAMILIES = [
    # Ours first: their names contain "gemm" too; the router before the expert GEMMs
    # (`moe_wgmma_f32out` also matches `moe_wgmma`).
    ("MoE router logits (ours)", r"moe_gemm_f32out|moe_wgmma_f32out|moe_sum_slices"),
    ("MoE grouped expert GEMMs (ours)", r"moe_wgmma|moe_gemm_swiglu|moe_gemm_bm"),
    ("MoE routing and grouping (ours)", r"moe_route|moe_count|moe_offsets|moe_scatter"),
    ("MoE combine (ours)", r"moe_combine"),
    ("greedy readout (ours)", r"greedy_confidence"),
    ("FOCUS importance and compaction (ours)", r"focus_|compact_rows"),
    ("GEMM (cuBLAS)", r"gemm|gemv|xmma|cutlass|splitK|sm90_|sm80_|ampere_|nvjet"),
    ("attention (paged, ours)", r"paged_attn|paged_decode_ring"),
    ("K/V write + RoPE (fused, ours)", r"qkv_.*rope|write_kv|rope"),
    ("RMSNorm (+ residual add)", r"rms"),
    ("SiLU · mul", r"silu"),
    ("reductions (argmax, sum, max)", r"argmax|fast_sum|fast_max|fast_min|reduce|softmax"),
    ("gather / scatter / index", r"index_select|is_u32|is_u8|scatter|gather|where"),
    ("copies and casts", r"copy|cast|ucopy|memcpy|contiguous"),
    ("elementwise (affine, binary, unary)", r"affine|badd|bmul|bsub|bdiv|bmax|bminimum|add|mul|sub|div|exp|neg|sqrt|recip|unary|binary"),
]


def family(name):
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def layer_period(names):
    """The length of the repeating kernel sequence of a step (one layer application), found as the
    shortest period under which at least 90 % of the launches repeat; 0 when none does."""
    n = len(names)
    for p in range(2, n // 4 + 1):
        same = sum(names[i] == names[i + p] for i in range(n - p))
        if same >= 0.9 * (n - p):
            return p
    return 0


def by_position(seq):
    """Each kernel's mean µs by its position in the repeating layer sequence: tells launches of one
    kernel name apart by the role they play (o_proj and down share a cuBLAS kernel). The pattern
    is the first window of one period that the next window repeats; launches outside it (a norm
    between loops, the head) are skipped without moving the position, forwards from the pattern
    and backwards before it, so every layer application counts."""
    names = [n for n, _ in seq]
    p = layer_period(names)
    anchor = next((i for i in range(len(names) - 2 * p + 1) if names[i:i + p] == names[i + p:i + 2 * p]), None) if p else None
    if anchor is None:
        return 0, []
    slots = [[names[anchor + j], []] for j in range(p)]
    j = 0
    for name, ns in seq[anchor:]:
        if name == slots[j][0]:
            slots[j][1].append(ns)
            j = (j + 1) % p
    j = p - 1
    for name, ns in reversed(seq[:anchor]):
        if name == slots[j][0]:
            slots[j][1].append(ns)
            j = (j - 1) % p
    return p, [(j, name, len(v), sum(v) / len(v) / 1e3) for j, (name, v) in enumerate(slots) if v]


def main():
    path = sys.argv[1]
    text = lzma.open(path, "rt").read() if path.endswith(".xz") else open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
    total, by_family, by_name, seq = 0.0, {}, {}, []
    for r in rows:
        ns = float(r["Metric Value"].replace(",", ""))
        if r.get("Metric Unit", "ns") in ("usecond", "us"):
            ns *= 1e3
        elif r.get("Metric Unit") in ("msecond", "ms"):
            ns *= 1e6
        name = r["Kernel Name"]
        seq.append((name, ns))
        fam = family(name)
        total += ns
        f = by_family.setdefault(fam, [0, 0.0])
        f[0] += 1
        f[1] += ns
        n = by_name.setdefault(name[:90], [0, 0.0, fam])
        n[0] += 1
        n[1] += ns
    period, positions = by_position(seq)
    if "--json" in sys.argv:
        out = sys.argv[sys.argv.index("--json") + 1]
        meta = {k: sys.argv[sys.argv.index(f"--{k}") + 1] for k in ("gpu", "commit", "command") if f"--{k}" in sys.argv}
        json.dump({**meta, "source": path, "kernels": len(rows), "total_ms": total / 1e6,
                   "families": {f: {"kernels": k, "ms": ns / 1e6} for f, (k, ns) in by_family.items()},
                   "top": [{"kernel": n, "family": fam, "launches": k, "ms": ns / 1e6} for n, (k, ns, fam) in sorted(by_name.items(), key=lambda x: -x[1][1])[:40]],
                   "layer_period": period,
                   "by_position": [{"position": j, "kernel": n[:90], "family": family(n), "launches": k, "mean_us": us} for j, n, k, us in positions]},
                  open(out, "w"), indent=1)

    print(f"{len(rows)} kernels, {total / 1e6:.3f} ms of kernel time in the profiled step\n")
    print("| family | kernels | ms | share |\n|---|---:|---:|---:|")
    for fam, (k, ns) in sorted(by_family.items(), key=lambda x: -x[1][1]):
        print(f"| {fam} | {k} | {ns / 1e6:.3f} | {100 * ns / total:.1f} % |")
    if positions:
        print(f"\nOne layer application ({period} kernels, repeating), mean µs by position:\n\n| # | kernel | family | launches | mean µs |\n|---:|---|---|---:|---:|")
        for j, n, k, us in positions:
            print(f"| {j} | `{n[:70]}` | {family(n)} | {k} | {us:.2f} |")
    print("\nTop kernels:\n\n| kernel | family | launches | ms |\n|---|---|---:|---:|")
    for name, (k, ns, fam) in sorted(by_name.items(), key=lambda x: -x[1][1])[:15]:
        print(f"| `{name}` | {fam} | {k} | {ns / 1e6:.3f} |")


if __name__ == "__main__":
    main()
