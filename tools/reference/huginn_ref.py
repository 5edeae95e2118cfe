#!/usr/bin/env python3
"""An independent float64 numpy reference of Huginn-0125's recurrent-depth model, written from the
architecture description (../../shared/spec/looped-lms-and-cdb.md §3.1–3.2, §4.2), not from
Ponder's Rust code. It reads an HF-style directory (config.json with the released field names +
model.safetensors, f32 or bf16).

- e = wte[ids] · sqrt(h); prelude blocks on e.
- State s0 = 0 (how the CDB authors serve it); r recurrences of s = core(adapter([s, e])), the
  adapter a bias-free linear map of the concatenation (state first).
- x = ln_f(s); coda blocks; x = ln_f(x) (the same weight twice); logits = x · lm_headᵀ over the
  first `vocab_size` rows of the (padded) table.
- Sandwich block: x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x), RMSNorm everywhere.
- Attention: Wqkv rows [q; k; v]; qk_bias[0] added to q and qk_bias[1] to k before RoPE; RoPE on
  interleaved pairs (2i, 2i + 1) with inv_freq_i = base^(−2i/d); causal, scale 1/sqrt(d); proj.
- MLP: fc rows [gate; up], SiLU(gate) · up, proj.

Every layer application at recurrence r attends to the keys that application wrote for earlier
positions (one KV entry per block index, as upstream's cache keys them), so a full-depth greedy
generation is the whole sequence's forward again at every new token.

    python3 tools/reference/huginn_ref.py MODEL_DIR --prompt 3,5,7 --gen 6 --steps 6
"""
import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bidirectional_ref import load_safetensors  # noqa: E402  (a safetensors reader, no model code)


class Huginn:
    def __init__(self, model_dir):
        model_dir = pathlib.Path(model_dir)
        c = json.loads((model_dir / "config.json").read_text())
        self.w = load_safetensors(model_dir / "model.safetensors")
        self.h = c["n_embd"]
        self.heads = c["n_heads"]
        self.head_dim = c.get("head_dim") or self.h // self.heads
        assert (c.get("num_key_value_heads") or self.heads) == self.heads, "Huginn is MHA"
        self.eps = c.get("norm_eps", 1e-6)
        self.base = c.get("rope_base", 50000.0)
        self.vocab = c["vocab_size"]
        self.qk_bias = c.get("qk_bias", True)
        self.prelude = [f"transformer.prelude.{i}" for i in range(c["n_layers_in_prelude"])]
        self.core = [f"transformer.core_block.{i}" for i in range(c["n_layers_in_recurrent_block"])]
        self.coda = [f"transformer.coda.{i}" for i in range(c["n_layers_in_coda"])]
        tied = c.get("tie_embeddings", True) or "lm_head.weight" not in self.w
        self.head = self.w["transformer.wte.weight"] if tied else self.w["lm_head.weight"]

    def norm(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]

    def rope(self, x, positions):
        # x [t, heads, d]; rotate interleaved pairs.
        d = self.head_dim
        inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = positions[:, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def attention(self, x, p):
        t, (nh, d) = x.shape[0], (self.heads, self.head_dim)
        qkv = x @ self.w[f"{p}.attn.Wqkv.weight"].T
        q, k, v = (qkv[:, i * nh * d : (i + 1) * nh * d].reshape(t, nh, d) for i in range(3))
        if self.qk_bias:
            bias = self.w[f"{p}.attn.qk_bias"]  # [2, 1, heads, d]
            q, k = q + bias[0], k + bias[1]
        pos = np.arange(t)
        q, k = self.rope(q, pos), self.rope(k, pos)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((t, t), dtype=bool))[None], scores, -np.inf)
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(t, nh * d)
        return out @ self.w[f"{p}.attn.proj.weight"].T

    def mlp(self, x, p):
        gate_up = x @ self.w[f"{p}.mlp.fc.weight"].T
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :half], gate_up[:, half:]
        return (gate / (1.0 + np.exp(-gate)) * up) @ self.w[f"{p}.mlp.proj.weight"].T

    def block(self, x, p):
        x = self.norm(self.attention(self.norm(x, f"{p}.norm_1.weight"), p) + x, f"{p}.norm_2.weight")
        return self.norm(self.mlp(self.norm(x, f"{p}.norm_3.weight"), p) + x, f"{p}.norm_4.weight")

    def logits(self, ids, steps):
        """Logits `[len(ids), vocab]` of the whole sequence at `steps` recurrences, state 0."""
        e = self.w["transformer.wte.weight"][np.asarray(ids)] * np.sqrt(self.h)
        for p in self.prelude:
            e = self.block(e, p)
        s = np.zeros_like(e)
        adapter = self.w["transformer.adapter.weight"]
        for _ in range(steps):
            s = np.concatenate([s, e], axis=-1) @ adapter.T
            for p in self.core:
                s = self.block(s, p)
        x = self.norm(s, "transformer.ln_f.weight")
        for p in self.coda:
            x = self.block(x, p)
        x = self.norm(x, "transformer.ln_f.weight")
        return x @ self.head[: self.vocab].T


def log_softmax(z):
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def greedy(model, prompt, gen, steps):
    """Greedy tokens and each one's log-probability under the model."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(gen):
        lp = log_softmax(model.logits(ids, steps)[-1])
        t = int(np.argmax(lp))
        tokens.append(t)
        logprobs.append(float(lp[t]))
        ids.append(t)
    return tokens, logprobs


def score(model, prompt, forced, steps):
    """Each of `forced`'s log-probability after the prompt and the forced tokens before it."""
    ids, logprobs = list(prompt), []
    for t in forced:
        logprobs.append(float(log_softmax(model.logits(ids, steps)[-1])[t]))
        ids.append(t)
    return logprobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--gen", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    tokens, logprobs = greedy(Huginn(a.model_dir), [int(t) for t in a.prompt.split(",")], a.gen, a.steps)
    print(json.dumps({"tokens": tokens, "logprobs": logprobs}))


if __name__ == "__main__":
    main()
