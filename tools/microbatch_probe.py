"""Probe (PyTorch, on the device): does a looped decode step run faster as independent micro-batches
on parallel streams of one CUDA graph than as one batch? At 16-64 rows each kernel of the step is
latency-bound — cuBLAS's projections cost ≈ 3 µs + bytes ÷ 4.4 TB/s, and a persistent kernel of
our own did no better (tools/ring_probe.cu) — so the 96 dependent layer applications are a chain
of ≈ 1000 short kernels. Two chains of half the rows share nothing but the weights: one's kernels
could fill the other's gaps, and the weight one streams from DRAM may still be in L2 (50 MB) when
the other reads it.

The body stands in for a layer application of Ouro-1.4B (no attention: its bytes are per row and
do not change with the split): QKV, o_proj (k slices summed, as the library's norm of partials
does), residual + RMSNorm, gate/up, SiLU·mul, down (k slices), residual + RMSNorm; 96
applications over 24 layers' weights. Each variant is one CUDA graph: `k streams` forks k chains
of rows / k at the start and joins them at the end.

    python3 tools/microbatch_probe.py [--rows 16,64,256] [--json out.json]
"""
import argparse, json, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us, proj  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rows", default="16,64,256")
p.add_argument("--json")
a = p.parse_args()
dev = "cuda"
H, I, L, APPS = 2048, 5632, 24, 96
shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
W = {n: [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * (1.0 / i ** 0.5) for _ in range(L)]
     for n, (o, i) in shapes.items()}


def chain(h, split):
    """96 layer applications on h [rows, H] (bf16); k slices for o_proj and down when split."""
    for app in range(APPS):
        l = app % L
        qkv = F.linear(h, W["qkv"][l])
        o = proj(qkv[:, :H], W["o"][l], split)
        o = o.sum(0) if split > 1 else o
        n = F.rms_norm(o.to(torch.bfloat16) + h, (H,))
        gu = F.linear(n, W["gate_up"][l])
        m = F.silu(gu[:, :I]) * gu[:, I:]
        d = proj(m, W["down"][l], split)
        d = d.sum(0) if split > 1 else d
        h = F.rms_norm(d.to(torch.bfloat16) + n, (H,))
    return h


def step_us(rows, k, parallel):
    """µs per step: k chains of rows / k, on k streams of one graph (parallel) or one after another."""
    per = rows // k
    split = 4 if per <= 64 else 1  # the library's plan: o_proj and down in 4 slices at <= 64 rows
    xs = [torch.randn(per, H, device=dev, dtype=torch.bfloat16) for _ in range(k)]
    streams = [torch.cuda.Stream() for _ in range(k)]

    def body():
        if not parallel:
            for x in xs:
                chain(x, split)
            return
        main = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main)
        for x, s in zip(xs, streams):
            with torch.cuda.stream(s):
                chain(x, split)
        for s in streams:
            main.wait_stream(s)

    return graph_us(body, reps=10)


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "step_us": {}}
print(f"{out['gpu']}, torch {out['torch']}")
for rows in [int(r) for r in a.rows.split(",")]:
    for k, parallel in [(1, False), (2, True), (2, False), (4, True), (1, False)]:
        if rows // k < 4:
            continue
        us = step_us(rows, k, parallel)
        label = f"{rows}/{k}/{'parallel' if parallel else 'serial'}"
        out["step_us"].setdefault(label, []).append(us)
        print(f"rows {rows:3d}: {k} chain{'s' if k > 1 else ''} of {rows // k:3d} rows, "
              f"{'parallel streams' if parallel else 'one stream':16s}: {us / 1000:6.3f} ms")
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
