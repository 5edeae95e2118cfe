"""Probe (PyTorch + Triton, on the device): would a looped decode step gain from warming a
projection's weight into L2 on a side stream while the latency-bound kernels before it run?

Part 1 times each Ouro-1.4B projection at 16 rows in a CUDA graph of 96 calls, reading one
weight over and over (hot in L2) against 24 weights in turn (cold, as a step reads them).
Part 2 replays a simplified layer chain at W 16 (QKV, flash attention over 260 keys, o_proj and
down as 4 k slices, gate/up, SiLU·mul) 96 times in a graph, without and with a second stream that
touches the next o_proj (and down) weight while attention runs.

    python3 tools/l2_probe.py [--json out.json]
"""
import argparse, json, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us, proj  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--json")
a = p.parse_args()
dev = "cuda"
H, I, L, APPS, ROWS, CTX, NH, HD = 2048, 5632, 24, 96, 16, 260, 16, 128
shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
split = {"o": 4, "down": 4}
W = {n: [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)] for n, (o, i) in shapes.items()}
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

# Part 1: hot against cold weights.
out["hot_cold_us"] = {}
for name in shapes:
    x = torch.randn(ROWS, shapes[name][1], device=dev, dtype=torch.bfloat16)
    s = split.get(name, 1)
    cold = graph_us(lambda: [proj(x, W[name][i % L], s) for i in range(APPS)]) / APPS
    hot = graph_us(lambda: [proj(x, W[name][0], s) for i in range(APPS)]) / APPS
    mb = shapes[name][0] * shapes[name][1] * 2 / 1e6
    out["hot_cold_us"][name] = {"cold": cold, "hot": hot, "mb": mb}
    print(f"{name:8s} ({mb:5.1f} MB, {s} slices): cold {cold:6.2f} µs, hot in L2 {hot:6.2f} µs")

# Part 2: the layer chain, with and without warming on a side stream.
try:
    import triton, triton.language as tl

    @triton.jit
    def touch(ptr, n, sink, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        tl.store(sink + pid, tl.sum(acc))
    HAVE_TRITON = True
except Exception as e:  # noqa: BLE001
    print(f"no triton ({e}); part 2 skipped")
    HAVE_TRITON = False

if HAVE_TRITON:
    K = [torch.randn(ROWS, NH, CTX, HD, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    V = [torch.randn(ROWS, NH, CTX, HD, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    x0 = torch.randn(ROWS, H, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(1024, device=dev, dtype=torch.int32)
    flat = {n: [w.view(-1).view(torch.int32) for w in W[n]] for n in ("o", "down")}

    def chain(warm, programs):
        side = torch.cuda.Stream() if warm else None
        main = torch.cuda.current_stream()
        if side is not None:
            side.wait_stream(main)
        x = x0
        for app in range(APPS):
            l = app % L
            qkv = F.linear(x, W["qkv"][l])
            if side is not None:
                ev = torch.cuda.Event(); ev.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    for n in warm:
                        t = flat[n][l]
                        touch[(programs,)](t, t.numel(), sink, BLOCK=2048)
            q = qkv[:, :H].reshape(ROWS, NH, 1, HD)
            att = F.scaled_dot_product_attention(q, K[l], V[l]).reshape(ROWS, H)
            h = (x.float() + proj(att, W["o"][l], 4).sum(0)).to(torch.bfloat16)
            gu = F.linear(h, W["gate_up"][l])
            m = F.silu(gu[:, :I]) * gu[:, I:]
            x = (h.float() + proj(m, W["down"][l], 4).sum(0)).to(torch.bfloat16)
        if side is not None:
            main.wait_stream(side)
        return x

    out["chain_ms"] = {}
    for label, warm, progs in [("no warming", (), 0), ("warm o, 16 CTAs", ("o",), 16), ("warm o, 64 CTAs", ("o",), 64),
                               ("warm o + down, 32 CTAs", ("o", "down"), 32), ("no warming (again)", (), 0)]:
        ms = graph_us(lambda: chain(warm, progs), reps=10) / 1000
        out["chain_ms"][label] = ms
        print(f"layer chain x 96, {label:24s}: {ms:6.3f} ms")
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
