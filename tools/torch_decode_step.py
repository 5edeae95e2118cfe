#!/usr/bin/env python3
"""A full-depth decode step of a looped model written the plain PyTorch way, to compare ours with:
cuBLAS GEMMs (torch.matmul), flash SDPA, fused-by-nothing norms and SiLU, the whole step replayed
from a CUDA graph. Random bf16 weights at the real shapes; every row of the batch sees `--ctx`
keys in each loop step's own K/V (depth-indexed, as our benchmark's default layout).

    python3 tools/torch_decode_step.py --model ouro --widths 16,64,256 --ctx 256 [--json out.json]

Prints per width the median step time over `--iters` graph replays (after a warm-up), and the
time of the GEMMs alone (the same matmuls, graph-replayed), next to the weight bytes a step reads.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {
    # hidden, heads, kv heads, head dim, intermediate, layers per application, applications, vocab
    "ouro": dict(h=2048, nh=16, nkv=16, hd=128, inter=5632, layers=24, loops=4, vocab=49152),
    "huginn": dict(h=5280, nh=55, nkv=55, hd=96, inter=17920, layers=4, loops=32, vocab=65536),
}


def rms(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ouro", choices=SHAPES)
    ap.add_argument("--widths", default="16,64,256")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    s = SHAPES[a.model]
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    h, nh, nkv, hd, inter = s["h"], s["nh"], s["nkv"], s["hd"], s["inter"]
    layers = []
    for _ in range(s["layers"]):
        layers.append(dict(
            qkv=torch.randn((nh + 2 * nkv) * hd, h, device=dev, dtype=dt) * 0.02,
            o=torch.randn(h, nh * hd, device=dev, dtype=dt) * 0.02,
            gu=torch.randn(2 * inter, h, device=dev, dtype=dt) * 0.02,
            down=torch.randn(h, inter, device=dev, dtype=dt) * 0.02,
            n1=torch.ones(h, device=dev, dtype=dt), n2=torch.ones(h, device=dev, dtype=dt),
        ))
    head = torch.randn(s["vocab"], h, device=dev, dtype=dt) * 0.02
    apps = s["layers"] * s["loops"]
    weight_bytes = sum(v.numel() * 2 for l in layers for k, v in l.items() if k not in ("n1", "n2")) * s["loops"] + head.numel() * 2
    out = dict(model=a.model, ctx=a.ctx, gpu=torch.cuda.get_device_name(), torch=torch.__version__, weight_bytes_per_step=weight_bytes, rows=[])
    for w in [int(x) for x in a.widths.split(",")]:
        kv_bytes = apps * 2 * w * a.ctx * nkv * hd * 2
        caches = [(torch.randn(w, nkv, a.ctx + 1, hd, device=dev, dtype=dt), torch.randn(w, nkv, a.ctx + 1, hd, device=dev, dtype=dt)) for _ in range(apps)]
        x0 = torch.randn(w, h, device=dev, dtype=dt)
        cos = torch.randn(w, 1, hd // 2, device=dev, dtype=dt)
        sin = torch.randn(w, 1, hd // 2, device=dev, dtype=dt)
        static_out = torch.empty(w, dtype=torch.long, device=dev)

        def step(gemms_only=False):
            x = x0
            for app in range(apps):
                l = layers[app % s["layers"]]
                kc, vc = caches[app]
                a_ = x if gemms_only else rms(x, l["n1"])
                qkv = a_ @ l["qkv"].t()
                if gemms_only:
                    att = qkv[:, : nh * hd]
                else:
                    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
                    q = rope(q.view(w, nh, hd), cos, sin).unsqueeze(2)
                    k = rope(k.view(w, nkv, hd), cos, sin)
                    kc[:, :, a.ctx] = k
                    vc[:, :, a.ctx] = v.view(w, nkv, hd)
                    att = F.scaled_dot_product_attention(q, kc, vc).reshape(w, nh * hd)
                o = att @ l["o"].t()
                x = o if gemms_only else x + rms(o, l["n2"])
                gu = (x if gemms_only else rms(x, l["n2"])) @ l["gu"].t()
                m = gu[:, :inter] if gemms_only else F.silu(gu[:, :inter]) * gu[:, inter:]
                d = m @ l["down"].t()
                x = d if gemms_only else x + rms(d, l["n1"])
            logits = rms(x, layers[0]["n1"]) @ head.t()
            static_out.copy_(logits.argmax(-1))

        def timed(gemms_only):
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(3):
                    step(gemms_only)
            torch.cuda.current_stream().wait_stream(st)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(gemms_only)
            for _ in range(5):
                g.replay()
            times = []
            for _ in range(a.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            return statistics.median(times)

        with torch.no_grad():
            step_ms = timed(False)
            gemm_ms = timed(True)
        row = dict(width=w, step_ms=step_ms, gemms_only_ms=gemm_ms, kv_bytes=kv_bytes)
        out["rows"].append(row)
        print(f"{a.model} W={w:4d} ctx={a.ctx}: step {step_ms:7.3f} ms, GEMMs alone {gemm_ms:7.3f} ms, weights {weight_bytes/1e9:.2f} GB + K/V {kv_bytes/1e9:.2f} GB")
        del caches
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
