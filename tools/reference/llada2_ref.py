#!/usr/bin/env python3
"""An independent float64 PyTorch reference of LLaDA2.0 (`llada2_moe`), written from the model
description (../../shared/spec/llada2.md §3-4), not from Ponder's Rust code: the forward over a
whole canvas (block-causal attention with blocks from position 0, no cache) and the greedy
block-diffusion generate loop (threshold with a top-1 fallback, no remasking, output cut after
the first EOS).

    python3 tools/reference/llada2_ref.py MODEL_DIR 5,17,3 --gen 8 --block 4
"""
import argparse
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import block_diffusion_ref as block_diffusion  # noqa: E402
from ouro_ref import load_weights  # noqa: E402

D = torch.float64


class Llada2Reference:
    def __init__(self, model_dir):
        model_dir = pathlib.Path(model_dir)
        c = json.loads((model_dir / "config.json").read_text())
        assert c["model_type"] == "llada2_moe", c["model_type"]
        self.c = c
        self.w = {k: v.to(D) for k, v in load_weights(model_dir).items()}
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.hd = c.get("head_dim") or c["hidden_size"] // self.heads
        self.rot = int(round(self.hd * c.get("partial_rotary_factor", 0.5))) // 2 * 2
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 600000.0)
        self.first_moe = c.get("first_k_dense_replace", 1)
        self.mask_id = c.get("mask_token_id") or 156895
        self.qk_norm = c.get("use_qk_norm", True)

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, positions):
        # Split-half rotation of the first `rot` dims only; the rest pass through.
        r = self.rot
        inv = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=D) / r))
        ang = positions.to(D)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
        xr, rest = x[..., :r], x[..., r:]
        rotated = torch.cat([-xr[..., r // 2 :], xr[..., : r // 2]], -1)
        return torch.cat([xr * cos + rotated * sin, rest], -1)

    def route(self, b):
        """Chosen experts [T, k] (best first) and their weights [T, k] for MLP inputs b [T, H]."""
        c = self.c
        e, k = c["num_experts"], c["num_experts_per_tok"]
        g, kg = c.get("n_group", 1), c.get("topk_group", 1)
        p = self._p
        scores = torch.sigmoid(b @ self.w[f"{p}.mlp.gate.weight"].T)  # fp64 here, fp32 in the release
        choice = scores + self.w[f"{p}.mlp.gate.expert_bias"]
        if g > 1:
            per = e // g
            group = choice.view(-1, g, per).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group, dtype=torch.bool)
            keep.scatter_(1, group.topk(kg, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if c.get("norm_topk_prob", True):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * c.get("routed_scaling_factor", 1.0)

    def swiglu(self, x, prefix):
        w = self.w
        return (torch.nn.functional.silu(x @ w[f"{prefix}.gate_proj.weight"].T) * (x @ w[f"{prefix}.up_proj.weight"].T)) @ w[f"{prefix}.down_proj.weight"].T

    def layer(self, i, h, positions, mask, routes):
        w, p = self.w, f"model.layers.{i}"
        self._p = p
        t = h.shape[0]
        a = self.rms(h, w[f"{p}.input_layernorm.weight"])
        qkv = (a @ w[f"{p}.attention.query_key_value.weight"].T).view(t, self.heads + 2 * self.kv_heads, self.hd)
        q, k, v = qkv[:, : self.heads], qkv[:, self.heads : self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads :]
        if self.qk_norm:
            q = self.rms(q, w[f"{p}.attention.query_layernorm.weight"])
            k = self.rms(k, w[f"{p}.attention.key_layernorm.weight"])
        q, k = self.rope(q, positions), self.rope(k, positions)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd)
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(t, -1)
        h = h + attn @ w[f"{p}.attention.dense.weight"].T
        b = self.rms(h, w[f"{p}.post_attention_layernorm.weight"])
        if i < self.first_moe:
            return h + self.swiglu(b, f"{p}.mlp")
        chosen, weights = self.route(b)
        routes.append(chosen)
        out = torch.zeros_like(b)
        for j in range(chosen.shape[1]):
            for e in chosen[:, j].unique().tolist():
                rows = (chosen[:, j] == e).nonzero().squeeze(1)
                out[rows] += weights[rows, j : j + 1] * self.swiglu(b[rows], f"{p}.mlp.experts.{e}")
        return h + out + self.swiglu(b, f"{p}.mlp.shared_experts")

    @torch.no_grad()
    def forward(self, ids, block):
        """logits [T, vocab] of a canvas and the routes of each MoE layer ([T, k] each)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        t = len(ids)
        positions = torch.arange(t)
        blk = positions // block
        mask = blk[None, :] <= blk[:, None]  # query block sees key blocks <= its own
        h = self.w["model.word_embeddings.weight"][ids]
        routes = []
        for i in range(self.c["num_hidden_layers"]):
            h = self.layer(i, h, positions, mask, routes)
        h = self.rms(h, self.w["model.norm.weight"])
        return h @ self.w["lm_head.weight"].T, routes

    def generate(self, prompt, gen, block, threshold, eos=(), margins=None, draw=None):
        """Greedy block diffusion without a cache (block_diffusion_ref.py), threshold policy with
        the top-1 fallback: the released loop's structure with the deterministic servers'
        conventions where the releases differ."""
        return block_diffusion.generate(lambda ids: self.forward(ids, block)[0], self.mask_id, prompt, gen, block, ("threshold", threshold), eos, margins, draw)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompt", help="comma-separated ids")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.95)
    args = ap.parse_args()
    ref = Llada2Reference(args.model)
    print(ref.generate([int(x) for x in args.prompt.split(",")], args.gen, args.block, args.threshold))
