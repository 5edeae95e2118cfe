#!/usr/bin/env python3
"""An independent PyTorch forward of the Ouro architecture, written from the model description
(../../shared/spec/looped-lms-and-cdb.md §2), not from Ponder's Rust code. It reads an HF-style
model directory (config.json + model.safetensors or a sharded index) and computes, for one
sequence at full depth, the logits of every position and the exit-gate logit of every loop step.

    python3 tools/reference/ouro_ref.py assets/tiny-ouro "fn main() {"
"""
import json
import math
import pathlib
import sys

import torch
from safetensors.torch import load_file


def load_weights(model_dir: pathlib.Path) -> dict:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights = {}
        for f in files:
            weights.update(load_file(str(model_dir / f)))
        return weights
    return load_file(str(model_dir / "model.safetensors"))


class OuroReference:
    def __init__(self, model_dir, dtype=torch.float64):
        model_dir = pathlib.Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        assert self.cfg["model_type"] == "ouro", self.cfg["model_type"]
        self.w = {k: v.to(dtype) for k, v in load_weights(model_dir).items()}
        self.dtype = dtype
        c = self.cfg
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.steps = c.get("total_ut_steps", 4)
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 1e6)

    def rms(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * weight

    def rope(self, x, positions):
        # Split-half ("rotate_half") convention over the full head dimension.
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = positions.to(torch.float64)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        rotated = torch.cat([-x2, x1], -1)
        return x * cos + rotated * sin

    def layer(self, i, h, positions):
        """Layer `i` over the positions of `h` alone (causal, no cache)."""
        shape = (h.shape[0], self.kv_heads, self.head_dim)
        return self.cached_layer(i, h, positions, torch.zeros(shape, dtype=h.dtype), torch.zeros(shape, dtype=h.dtype))

    @torch.no_grad()
    def forward(self, ids):
        """logits [T, vocab] after the last loop, gate logits [steps, T]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        positions = torch.arange(len(ids))
        h = self.w["model.embed_tokens.weight"][ids]
        gates = []
        for _ in range(self.steps):
            for i in range(self.cfg["num_hidden_layers"]):
                h = self.layer(i, h, positions)
            h = self.rms(h, self.w["model.norm.weight"])  # final norm after every loop
            gates.append((h @ self.w["model.early_exit_gate.weight"].T + self.w["model.early_exit_gate.bias"]).squeeze(-1))
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return h @ head.T, torch.stack(gates)

    @torch.no_grad()
    def generate_gated(self, prompt, gen, q, min_steps, layout, margins=None, delay=0, copy="exit"):
        """Greedy decoding of `gen` tokens, each decode token exiting by Q-exit (the CDB authors'
        cumulative hazard: after step r, cdf += sigmoid(z_r)·survival, survival *= 1 − sigmoid(z_r);
        exit once cdf >= q and r + 1 >= min_steps, or at the last step), decided on step r's own
        gate logit, over a K/V cache of the given layout (spec §1.6): `shared` — one slot a layer,
        each step overwrites it, so an earlier token is read at its exit step; `last_exited` — a
        slot per step, and on exit at step e a token's step-e K/V fills its slots e+1…. The prompt
        runs at full depth and gives the first token. With `delay` 1 the verdict on step r's logit
        takes effect after step r + 1 (the CDB authors' delayed gate consumption, §1.4: a token
        whose step-r cdf reaches q exits with r + 2 steps). Returns (tokens, loop steps per token,
        each token's log-probability);
        with a list as `margins`, |cdf − q| of every decision that could end a token early and the
        top-2 logit gap of every token are appended. `copy` other than "exit" ("previous": the
        slot before the exit step's, "none") is a wrong last-exited rule, for the fixture maker to
        check that its decodes would catch one."""
        R, L = self.steps, self.cfg["num_hidden_layers"]
        slots = 1 if layout == "shared" else R
        assert layout in ("shared", "last_exited"), layout
        n = len(prompt) + gen
        shape = (n, self.kv_heads, self.head_dim)
        kc = [[torch.zeros(shape, dtype=self.dtype) for _ in range(L)] for _ in range(slots)]
        vc = [[torch.zeros(shape, dtype=self.dtype) for _ in range(L)] for _ in range(slots)]
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

        def loop_step(h, start, r):
            """One loop over the layers for positions start.., writing their K/V in step r's slot."""
            slot = min(r, slots - 1)
            t = h.shape[0]
            positions = torch.arange(start, start + t)
            for i in range(L):
                h = self.cached_layer(i, h, positions, kc[slot][i], vc[slot][i])
            return self.rms(h, self.w["model.norm.weight"])

        h = self.w["model.embed_tokens.weight"][torch.as_tensor(prompt)]
        for r in range(R):
            h = loop_step(h, 0, r)
        first = (h[-1] @ head.T).log_softmax(-1)
        token = int(first.argmax())
        tokens, depths, logprobs = [token], [R], [float(first[token])]
        for pos in range(len(prompt), n - 1):
            h = self.w["model.embed_tokens.weight"][torch.as_tensor([token])]
            cdf, survival, pending = 0.0, 1.0, False
            for r in range(R):
                h = loop_step(h, pos, r)
                z = float(h[0] @ self.w["model.early_exit_gate.weight"][0] + self.w["model.early_exit_gate.bias"][0])
                hazard = 1.0 / (1.0 + math.exp(-z))
                cdf += hazard * survival
                survival *= 1.0 - hazard
                verdict = cdf >= q and r + 1 >= min_steps
                if margins is not None and r + 1 >= min_steps and r + 1 + delay < R:
                    margins.append(abs(cdf - q))
                exit_now = (verdict if delay == 0 else pending) or r + 1 == R
                pending = verdict
                if exit_now:
                    break
            if layout == "last_exited" and copy != "none":
                src = r if copy == "exit" else max(r - 1, 0)
                for later in range(r + 1, R):
                    for i in range(L):
                        kc[later][i][pos], vc[later][i][pos] = kc[src][i][pos], vc[src][i][pos]
            logits = h[0] @ head.T
            if margins is not None:
                top2 = logits.topk(2).values
                margins.append(float(top2[0] - top2[1]))
            token = int(logits.argmax())
            tokens.append(token)
            depths.append(r + 1)
            logprobs.append(float(logits.log_softmax(-1)[token]))
        return tokens, depths, logprobs

    def cached_layer(self, i, h, positions, k_cache, v_cache):
        """`layer` for new positions whose K/V are written into `k_cache` / `v_cache` (all
        positions of one slot), attending causally to every cached position up to their own."""
        w = self.w
        p = f"model.layers.{i}"
        t = h.shape[0]
        a = self.rms(h, w[f"{p}.input_layernorm.weight"])
        q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, self.heads, self.head_dim)
        k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        q, k = self.rope(q, positions), self.rope(k, positions)
        end = int(positions[-1]) + 1
        k_cache[positions], v_cache[positions] = k, v
        rep = self.heads // self.kv_heads
        keys = k_cache[:end].repeat_interleave(rep, dim=1)
        values = v_cache[:end].repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.head_dim)
        mask = torch.arange(end)[None, :] > positions[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(t, -1)
        attn = attn @ w[f"{p}.self_attn.o_proj.weight"].T
        h = h + self.rms(attn, w[f"{p}.input_layernorm_2.weight"])
        m = self.rms(h, w[f"{p}.post_attention_layernorm.weight"])
        gate = m @ w[f"{p}.mlp.gate_proj.weight"].T
        up = m @ w[f"{p}.mlp.up_proj.weight"].T
        m = (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T
        return h + self.rms(m, w[f"{p}.post_attention_layernorm_2.weight"])


if __name__ == "__main__":
    from tokenizers import Tokenizer

    model_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "assets/tiny-ouro")
    text = sys.argv[2] if len(sys.argv) > 2 else "fn main() {"
    ref = OuroReference(model_dir)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    logits, gates = ref.forward(ids)
    print("ids", ids)
    print("argmax of last position", int(logits[-1].argmax()))
    print("gate logits of last position per step", [round(float(g), 5) for g in gates[:, -1]])
