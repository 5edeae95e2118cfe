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

    def attention(self, x, p, positions=None, cache=None):
        """Attention of the rows of `x` at `positions` (default 0..t−1). With `cache` (a pair of
        `[positions, heads, d]` arrays) their keys and values are written there and every cached
        position up to a row's own is attended to; without, the rows attend to each other."""
        t, (nh, d) = x.shape[0], (self.heads, self.head_dim)
        pos = np.arange(t) if positions is None else np.asarray(positions)
        if cache is None:
            cache = (np.zeros((t, nh, d)), np.zeros((t, nh, d)))
        qkv = x @ self.w[f"{p}.attn.Wqkv.weight"].T
        q, k, v = (qkv[:, i * nh * d : (i + 1) * nh * d].reshape(t, nh, d) for i in range(3))
        if self.qk_bias:
            bias = self.w[f"{p}.attn.qk_bias"]  # [2, 1, heads, d]
            q, k = q + bias[0], k + bias[1]
        q, k = self.rope(q, pos), self.rope(k, pos)
        cache[0][pos], cache[1][pos] = k, v
        end = int(pos[-1]) + 1
        k, v = cache[0][:end], cache[1][:end]
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where((np.arange(end)[None, :] <= pos[:, None])[None], scores, -np.inf)
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

    def block(self, x, p, positions=None, cache=None):
        x = self.norm(self.attention(self.norm(x, f"{p}.norm_1.weight"), p, positions, cache) + x, f"{p}.norm_2.weight")
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


    def generate_gated(self, prompt, gen, threshold, steps, layout, margins=None, copy="exit"):
        """Greedy decoding whose decode tokens exit by the latent difference (the CDB authors'
        criterion, spec §3.4): after recurrence r, ‖s_r − s_{r−1}‖ / ‖s_r‖ (s_{−1} the zero initial
        state) below `threshold` ends the token's loop, at most `steps` recurrences; the coda runs
        on the last state. K/V: prelude and coda blocks one entry a position; core blocks by the
        layout (spec §1.6) — `shared`: one slot each recurrence overwrites, so an earlier token is
        read at its exit recurrence; `last_exited`: a slot a recurrence, and on exit after e + 1
        recurrences a token's slot-e K/V fills its later slots. The prompt runs at full depth and
        gives the first token. Returns (tokens, recurrences per token, each token's
        log-probability); with a list as `margins`,
        |diff − threshold| of every decision that could end a token early and the top-2 logit gap
        of every token are appended. `copy` other than "exit" ("previous": the slot before the
        exit recurrence's, "none") is a wrong last-exited rule, for the fixture maker to check that
        its decodes would catch one."""
        assert layout in ("shared", "last_exited"), layout
        n, (nh, d) = len(prompt) + gen, (self.heads, self.head_dim)
        new = lambda: (np.zeros((n, nh, d)), np.zeros((n, nh, d)))  # noqa: E731
        slots = 1 if layout == "shared" else steps
        prelude = {p: new() for p in self.prelude}
        core = [{p: new() for p in self.core} for _ in range(slots)]
        coda = {p: new() for p in self.coda}
        adapter = self.w["transformer.adapter.weight"]

        def run(ids, start, decide):
            pos = np.arange(start, start + len(ids))
            e = self.w["transformer.wte.weight"][np.asarray(ids)] * np.sqrt(self.h)
            for p in self.prelude:
                e = self.block(e, p, pos, prelude[p])
            s = np.zeros_like(e)
            for r in range(steps):
                prev = s
                s = np.concatenate([s, e], axis=-1) @ adapter.T
                for p in self.core:
                    s = self.block(s, p, pos, core[min(r, slots - 1)][p])
                if decide is not None and decide(r, s, prev):
                    break
            if layout == "last_exited" and copy != "none":
                src = r if copy == "exit" else max(r - 1, 0)
                for later in range(r + 1, steps):
                    for p in self.core:
                        for c in range(2):
                            core[later][p][c][pos] = core[src][p][c][pos]
            x = self.norm(s, "transformer.ln_f.weight")
            for p in self.coda:
                x = self.block(x, p, pos, coda[p])
            return (self.norm(x, "transformer.ln_f.weight") @ self.head[: self.vocab].T)[-1], r + 1

        def decide(r, s, prev):
            diff = float(np.linalg.norm(s - prev) / np.linalg.norm(s))
            if margins is not None and r + 1 < steps:
                margins.append(abs(diff - threshold))
            return diff < threshold

        logits, _ = run(prompt, 0, None)
        tokens, depths, logprobs = [int(np.argmax(logits))], [steps], [float(log_softmax(logits).max())]
        for pos in range(len(prompt), n - 1):
            logits, depth = run([tokens[-1]], pos, decide)
            if margins is not None:
                top2 = np.sort(logits)[-2:]
                margins.append(float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(logits)))
            depths.append(depth)
            logprobs.append(float(log_softmax(logits).max()))
        return tokens, depths, logprobs


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
