"""Probe (PyTorch, on the device): do Ouro-1.4B's decode projections at 16-64 rows run faster
as a batch of K slices (cuBLAS strided-batched GEMM, f32 partials summed later by the norm that
follows) than as one GEMM? Times a CUDA graph of 96 layer applications (24 distinct layers' weights
cycled, as a looped step reads them) per variant and prints microseconds per projection.

    python3 tools/splitk_probe.py [--rows 16,64] [--json out.json]
"""
import argparse, json, os, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us, proj  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rows", default="16,64")
p.add_argument("--json")
a = p.parse_args()
dev = "cuda"
H, I, L, APPS = 2048, 5632, 24, 96
shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
W = {n: [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
     for n, (o, i) in shapes.items()}


def step(xs, split):
    for app in range(APPS):
        l = app % L
        for n in shapes:
            proj(xs[n], W[n][l], split.get(n, 1))


def time_graph(rows, split):
    """µs per replay of a step's 384 projections."""
    xs = {n: torch.randn(rows, i, device=dev, dtype=torch.bfloat16) for n, (o, i) in shapes.items()}
    return graph_us(lambda: step(xs, split))


def one_proj(rows, name, s):
    """µs per call of one projection in a graph of 96 (other projections absent)."""
    x = torch.randn(rows, shapes[name][1], device=dev, dtype=torch.bfloat16)
    return graph_us(lambda: [proj(x, W[name][app % L], s) for app in range(APPS)]) / APPS


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "per_projection_us": {}, "step_us": {}}
print(f"{out['gpu']}, torch {out['torch']}")
for rows in [int(r) for r in a.rows.split(",")]:
    for name in shapes:
        for s in (1, 2, 4, 8):
            us = one_proj(rows, name, s)
            mb = shapes[name][0] * shapes[name][1] * 2 / 1e6
            out["per_projection_us"][f"{rows}/{name}/{s}"] = us
            print(f"rows {rows:3d} {name:8s} split {s}: {us:6.2f} µs  ({mb / us:5.2f} TB/s)")
    for label, split in [("none", {}), ("o4 down4", {"o": 4, "down": 4}),
                         ("o4 down4 qkv2 gu2", {"o": 4, "down": 4, "qkv": 2, "gate_up": 2}),
                         ("o8 down8 qkv2 gu2", {"o": 8, "down": 8, "qkv": 2, "gate_up": 2})]:
        us = time_graph(rows, split)
        out["step_us"][f"{rows}/{label}"] = us
        print(f"rows {rows:3d} 384 projections, split {label:20s}: {us / 1000:6.3f} ms")
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
