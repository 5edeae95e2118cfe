#!/usr/bin/env python3
"""An independent PyTorch forward of the SDAR architecture (JetAstra/SDAR; Qwen3 layout), written
from the model description (../../shared/spec/diffusion-lms-and-focus.md §3.5, §6.1, §7), not
from Ponder's Rust code nor from tools/train/train_sdar.py. It reads an HF-style model directory
(config.json + model.safetensors or a sharded index) and computes, in float64, the logits of
every position of one canvas under block-causal attention: a token attends to all tokens of its
own block (block_size from config.json) and of every earlier block. No logit shift: the logits
at position i are the prediction for the token at i (masked positions included). `generate`
runs the greedy block-diffusion loop of block_diffusion_ref.py over that forward.

    python3 tools/reference/sdar_ref.py assets/tiny-sdar "fn main() {"
"""
import json
import math
import pathlib
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import block_diffusion_ref as block_diffusion  # noqa: E402


def load_weights(model_dir: pathlib.Path) -> dict:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights = {}
        for f in files:
            weights.update(load_file(str(model_dir / f)))
        return weights
    return load_file(str(model_dir / "model.safetensors"))


class SDARReference:
    def __init__(self, model_dir, dtype=torch.float64, block_size=None):
        model_dir = pathlib.Path(model_dir)
        self.cfg = c = json.loads((model_dir / "config.json").read_text())
        assert c["model_type"] in ("sdar", "sdar_moe"), c["model_type"]
        assert not c.get("attention_bias", False), "SDAR has no attention biases"
        self.w = {k: v.to(dtype) for k, v in load_weights(model_dir).items()}
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        self.block = block_size or c.get("block_size") or 4
        self.mask_id = c.get("mask_token_id")
        self.layers = c["num_hidden_layers"]
        # Qwen3-MoE layers (sdar_moe): every decoder_sparse_step-th layer not in mlp_only_layers.
        step = c.get("decoder_sparse_step") or 1
        experts = c.get("num_experts") or 0
        self.moe = [experts > 0 and i not in c.get("mlp_only_layers", []) and (i + 1) % step == 0 for i in range(self.layers)]
        self.routes = []  # (MLP input of every position, their experts) per MoE layer of the last forward

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, positions):
        # x [T, H, D]; split-half ("rotate_half") convention over the full head dimension.
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = positions.to(torch.float64)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    def allowed(self, t):
        """[t, t] bool: query i may attend key j iff block(j) <= block(i)."""
        blk = torch.arange(t) // self.block
        return blk[None, :] <= blk[:, None]

    def layer(self, i, h, positions, allowed):
        w, p, t = self.w, f"model.layers.{i}", h.shape[0]
        a = self.rms(h, w[f"{p}.input_layernorm.weight"])
        q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, self.heads, self.head_dim)
        k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        q = self.rms(q, w[f"{p}.self_attn.q_norm.weight"])  # per head, over head_dim, before RoPE
        k = self.rms(k, w[f"{p}.self_attn.k_norm.weight"])
        q, k = self.rope(q, positions), self.rope(k, positions)
        group = self.heads // self.kv_heads  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
        h = h + attn @ w[f"{p}.self_attn.o_proj.weight"].T
        m = self.rms(h, w[f"{p}.post_attention_layernorm.weight"])
        if self.moe[i]:
            return h + self.moe_mlp(m, p)
        gate = m @ w[f"{p}.mlp.gate_proj.weight"].T
        up = m @ w[f"{p}.mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T

    def moe_mlp(self, m, p):
        # Softmax over all experts, top-k, optionally renormalised; no groups, bias or shared expert.
        c, w = self.cfg, self.w
        probs = (m @ w[f"{p}.mlp.gate.weight"].T).softmax(-1)
        weights, chosen = probs.topk(c["num_experts_per_tok"], dim=-1)
        if c.get("norm_topk_prob"):
            weights = weights / weights.sum(-1, keepdim=True)
        self.routes.append((m.tolist(), chosen.tolist()))
        out = torch.zeros_like(m)
        for t in range(m.shape[0]):
            for j, e in enumerate(chosen[t].tolist()):
                x = m[t : t + 1]
                y = (torch.nn.functional.silu(x @ w[f"{p}.mlp.experts.{e}.gate_proj.weight"].T) * (x @ w[f"{p}.mlp.experts.{e}.up_proj.weight"].T)) @ w[
                    f"{p}.mlp.experts.{e}.down_proj.weight"
                ].T
                out[t] += weights[t, j] * y[0]
        return out

    @torch.no_grad()
    def forward(self, ids):
        """logits [T, vocab] of every canvas position (block-causal attention, positions 0..T-1)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        t = len(ids)
        positions = torch.arange(t)
        allowed = self.allowed(t)
        self.routes = []
        h = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.layers):
            h = self.layer(i, h, positions, allowed)
        h = self.rms(h, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight"] if self.cfg.get("tie_word_embeddings") else self.w["lm_head.weight"]
        return h @ head.T


    def generate(self, prompt, gen, policy, eos=(), margins=None, draw=None):
        """Greedy block diffusion without a cache over blocks of `self.block` (block_diffusion_ref.py)."""
        return block_diffusion.generate(self.forward, self.mask_id, prompt, gen, self.block, policy, eos, margins, draw)


def decode_canvas(prompt_ids, block, mask_id):
    """The prompt followed by masks up to the next block boundary plus one more full block; the
    first decode block is the block holding the prompt's end (a partial prompt block is part of
    it). Returns (canvas, start, end) of the first decode block."""
    n = len(prompt_ids)
    start = n // block * block
    end = start + block
    return list(prompt_ids) + [mask_id] * (end + block - n), start, end


if __name__ == "__main__":
    from tokenizers import Tokenizer

    model_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "assets/tiny-sdar")
    text = sys.argv[2] if len(sys.argv) > 2 else "fn main() {"
    ref = SDARReference(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    canvas, start, end = decode_canvas(ids, ref.block, ref.mask_id)
    logits = ref.forward(canvas)
    guess = list(canvas)
    for i in range(len(ids), end):
        guess[i] = int(logits[i].argmax())
    print("canvas", canvas)
    print(f"one-step argmax fill of the first decode block [{start}, {end}):", repr(tok.decode(guess[:end])))
