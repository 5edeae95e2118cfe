#!/usr/bin/env python3
"""An independent float64 numpy reference of the two bidirectional diffusion families and of
how their references decode them, written from the model and decoding descriptions
(../../shared/spec/diffusion-lms-and-focus.md §3.1–3.3, §4, §5, §7), not from Ponder's Rust code.

Models (read from an HF-style directory: config.json + model.safetensors, f32 or bf16):
- LLaDA (`model_type` llada, OLMo-style names `model.transformer.*`): RMSNorm, RoPE (half split),
  GQA, bidirectional attention, SwiGLU with the activation on `ff_proj`, final `ln_f`, head
  `model.transformer.ff_out` (or `wte` when tied). No logit shift.
- Dream (`model_type` Dream, Qwen2 names `model.*`): q/k/v biases, the same blocks, `model.norm`,
  `lm_head`. Logits shifted: the logits at position i − 1 predict the token at i.

Decoding, greedy (argmax with the mask token's logit at −∞); by default no cache (every step a
forward over the whole canvas = prompt followed by `gen` mask tokens), for LLaDA also Fast-dLLM's
caches (spec §3.3): a block's first step runs the whole canvas and keeps every position's keys and
values; its later steps run only the block and every position after it (`prefix`: the prefix's
keys and values as that first step left them) or only the block (`dual`: the suffix's too):
- `semi_ar`: LLaDA's `generate`: blocks of `block` positions from the prompt's end (the last one
  shorter when `gen` is not a multiple), `steps` steps per block; per step the masked positions of
  the current block are ranked by the greedy token's probability and the top k revealed, k by
  the schedule — `linear` (⌊M/S⌋, +1 in the first M mod S steps), `static:N` (N per step) or
  `threshold:T` (all ≥ T, at least the top one) — and every remaining one on the block's last
  step. Ties go to the lower position.
- `dream`: Dream's sampler: one block of the whole generation, `steps` steps, step i reveals
  ⌊n·(1 − t_{i+1}/t_i)⌋ of the n masked positions (t_i = 1 − i·(1 − 10⁻³)/steps), all at the last
  step, ranked by `maskgit_plus` (top-1 probability), `topk_margin` (top-1 − top-2) or `entropy`
  (Σ p·ln(p + 1e-10)).

    python3 tools/reference/bidirectional_ref.py MODEL_DIR --prompt 3,5,7 --gen 12 --block 4 --steps 2 --schedule linear
"""
import argparse
import json
import math
import pathlib
import struct
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from diffusion_sampling import family_sampler, sample  # noqa: E402


def load_safetensors(path: pathlib.Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        if info["dtype"] == "F32":
            values = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "BF16":  # the top half of an f32
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{name}: {info['dtype']} (the reference reads f32 and bf16 checkpoints)")
        out[name] = values.reshape(info["shape"]).astype(np.float64)
    return out


class Model:
    def __init__(self, model_dir):
        model_dir = pathlib.Path(model_dir)
        self.cfg = c = json.loads((model_dir / "config.json").read_text())
        self.w = load_safetensors(model_dir / "model.safetensors")
        self.kind = c["model_type"].lower()
        assert self.kind in ("llada", "dream"), c["model_type"]
        if self.kind == "llada":
            self.layers, self.heads, self.hidden = c["n_layers"], c["n_heads"], c["d_model"]
            self.kv_heads = c.get("n_kv_heads") or self.heads
            self.eps = c.get("rms_norm_eps", 1e-5)
        else:
            self.layers, self.heads, self.hidden = c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"]
            self.kv_heads = c.get("num_key_value_heads") or self.heads
            self.eps = c.get("rms_norm_eps", 1e-6)
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.theta = c.get("rope_theta", 10000.0)
        self.mask_id = c["mask_token_id"]
        self.shift = self.kind == "dream"

    def rms(self, x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def rope(self, x, positions):
        d = self.head_dim
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        ang = positions[:, None] * inv[None, :]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
        sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    def names(self, i):
        if self.kind == "llada":
            p = f"model.transformer.blocks.{i}"
            return dict(attn_norm=f"{p}.attn_norm.weight", q=f"{p}.q_proj", k=f"{p}.k_proj", v=f"{p}.v_proj", o=f"{p}.attn_out.weight",
                        mlp_norm=f"{p}.ff_norm.weight", gate=f"{p}.ff_proj.weight", up=f"{p}.up_proj.weight", down=f"{p}.ff_out.weight")
        p = f"model.layers.{i}"
        return dict(attn_norm=f"{p}.input_layernorm.weight", q=f"{p}.self_attn.q_proj", k=f"{p}.self_attn.k_proj", v=f"{p}.self_attn.v_proj",
                    o=f"{p}.self_attn.o_proj.weight", mlp_norm=f"{p}.post_attention_layernorm.weight", gate=f"{p}.mlp.gate_proj.weight",
                    up=f"{p}.mlp.up_proj.weight", down=f"{p}.mlp.down_proj.weight")

    def linear(self, x, name):
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def logits(self, ids, fresh=None, cache=None):
        """[len(ids), vocab] logits of one canvas, bidirectional attention. With `fresh` (sorted
        positions), only those run; every position's keys and values come from `cache` (per
        layer, as the last full run left them) except theirs, and the other rows are NaN. A full
        run (`fresh` None) fills `cache` when one is given."""
        w = self.w
        t = len(ids)
        run = np.arange(t) if fresh is None else np.asarray(fresh)
        emb = w["model.transformer.wte.weight"] if self.kind == "llada" else w["model.embed_tokens.weight"]
        h = emb[np.asarray(ids)[run]]
        positions = run.astype(np.float64)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            n = self.names(i)
            x = self.rms(h, w[n["attn_norm"]])
            q = self.rope(self.linear(x, n["q"]).reshape(len(run), self.heads, self.head_dim), positions)
            k = self.rope(self.linear(x, n["k"]).reshape(len(run), self.kv_heads, self.head_dim), positions)
            v = self.linear(x, n["v"]).reshape(len(run), self.kv_heads, self.head_dim)
            if fresh is None:
                if cache is not None:
                    cache[i] = (k, v)
            else:
                cached_k, cached_v = cache[i]
                k_all, v_all = cached_k.copy(), cached_v.copy()
                k_all[run], v_all[run] = k, v
                k, v = k_all, v_all
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
            scores -= scores.max(-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(-1, keepdims=True)
            h = h + np.einsum("hqk,khd->qhd", p, v).reshape(len(run), -1) @ w[n["o"]].T
            x = self.rms(h, w[n["mlp_norm"]])
            gate, up = x @ w[n["gate"]].T, x @ w[n["up"]].T
            h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[n["down"]].T
        if self.kind == "llada":
            h = self.rms(h, w["model.transformer.ln_f.weight"])
            head = w.get("model.transformer.ff_out.weight", w["model.transformer.wte.weight"])
        else:
            h = self.rms(h, w["model.norm.weight"])
            head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        out = np.full((t, head.shape[0]), np.nan)
        out[run] = h @ head.T
        return out

    def step(self, x, order="maskgit_plus", fresh=None, cache=None, gaps=None, draw=None, step=0):
        """Per canvas position, the greedy token and its confidence for the token *at* that
        position (Dream's shift applied); `fresh` / `cache` as in `logits`. A list as `gaps`
        receives each position's gap between its best and second-best token's probability.
        With a `draw` (diffusion_sampling.Draw) the token is the family's sample instead, `step`
        the request's denoising steps before this one, and `gaps` each draw's margin."""
        logits = self.logits(x, fresh, cache)
        if self.shift:
            logits = np.concatenate([logits[:1], logits[:-1]], 0)
        logits[:, self.mask_id] = -np.inf
        if draw is not None:
            sampler = draw.sampler or family_sampler(self.kind)
            # The logits at position i − 1 predict token i under Dream's shift (0 its own).
            # Only masked positions are read (the cached modes leave other rows' logits unset).
            drawn = [sample(logits[i], draw, step, max(i - self.shift, 0), sampler, order) if x[i] == self.mask_id and np.isfinite(logits[i].max()) else (0, 0.0, 1.0) for i in range(len(x))]
            if gaps is not None:
                gaps[:] = [m for _, _, m in drawn]
            return np.array([t for t, _, _ in drawn]), np.array([c for _, c, _ in drawn])
        logits -= logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(-1, keepdims=True)
        tokens = probs.argmax(-1)
        if gaps is not None:
            top2 = np.sort(probs, -1)[:, -2:]
            gaps[:] = list(top2[:, 1] - top2[:, 0])
        if order == "maskgit_plus":
            conf = probs.max(-1)
        elif order == "topk_margin":
            top = np.sort(probs, -1)
            conf = top[:, -1] - top[:, -2]
        elif order == "entropy":
            conf = (probs * np.log(probs + 1e-10)).sum(-1)
        else:
            raise ValueError(order)
        return tokens, conf


def top(positions, conf, k):
    """The k most confident positions, ties to the lower position."""
    return sorted(positions, key=lambda i: (-conf[i], i))[:k]


def cut_margin(masked, conf, pick):
    """How far a step's choice among `masked` was from another: the confidence gap between the
    last position taken and the first left (none when all or none are taken)."""
    ranked = sorted(masked, key=lambda i: (-conf[i], i))
    k = len(pick)
    return [abs(conf[ranked[k - 1]] - conf[ranked[k]])] if 0 < k < len(ranked) else []


def semi_ar(model, prompt, gen, block, steps, schedule, cache="exact", margins=None, draw=None):
    """LLaDA's generate (module docs); with a list as `margins`, each step appends how close it
    came to deciding otherwise (a best-token probability gap or a draw's margin, the cut between
    revealed and kept positions, a confidence against τ). `draw`: sample (Model.step)."""
    assert cache == "exact" or not model.shift, "the cached modes are written for unshifted logits (LLaDA)"
    x = list(prompt) + [model.mask_id] * gen
    p = len(prompt)
    n = 0  # denoising steps run
    for start in range(p, p + gen, block):
        end = min(start + block, p + gen)
        m0 = end - start
        kv = {}
        for step in range(steps):
            masked = [i for i in range(start, end) if x[i] == model.mask_id]
            if not masked:
                break
            gaps = []
            if cache == "exact" or step == 0:
                tokens, conf = model.step(x, cache=kv, gaps=gaps, draw=draw, step=n)
            elif cache == "prefix":
                tokens, conf = model.step(x, fresh=list(range(start, p + gen)), cache=kv, gaps=gaps, draw=draw, step=n)
            elif cache == "dual":
                tokens, conf = model.step(x, fresh=list(range(start, end)), cache=kv, gaps=gaps, draw=draw, step=n)
            else:
                raise ValueError(cache)
            n += 1
            if step + 1 >= steps:
                pick = masked
            elif schedule == "linear":
                pick = top(masked, conf, m0 // steps + (1 if step < m0 % steps else 0))
            elif schedule.startswith("static:"):
                pick = top(masked, conf, int(schedule.split(":")[1]))
            elif schedule.startswith("threshold:"):
                tau = float(schedule.split(":")[1])
                pick = [i for i in masked if conf[i] >= tau] or top(masked, conf, 1)
            else:
                raise ValueError(schedule)
            if margins is not None:
                close = [gaps[i] for i in masked] + cut_margin(masked, conf, pick)
                if schedule.startswith("threshold:") and step + 1 < steps:
                    close += [abs(conf[i] - tau) for i in masked]
                margins.append(min(close))
            for i in pick:
                x[i] = int(tokens[i])
    return x[p:]


def dream_sampler(model, prompt, gen, steps, order, eps=1e-3, margins=None, draw=None):
    """Dream's sampler (module docs); `margins` and `draw` as in `semi_ar`."""
    x = list(prompt) + [model.mask_id] * gen
    p = len(prompt)
    t = [1.0 - i * (1.0 - eps) / steps for i in range(steps + 1)]
    for i in range(steps):
        masked = [j for j in range(p, p + gen) if x[j] == model.mask_id]
        if not masked:
            break
        gaps = []
        tokens, conf = model.step(x, order, gaps=gaps, draw=draw, step=i)
        k = len(masked) if i + 1 >= steps else math.floor(len(masked) * (1.0 - t[i + 1] / t[i]))
        pick = top(masked, conf, k)
        if margins is not None:
            margins.append(min([gaps[j] for j in masked] + cut_margin(masked, conf, pick)))
        for j in pick:
            x[j] = int(tokens[j])
    return x[p:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--gen", type=int, required=True)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--schedule", default="linear", help="linear | static:N | threshold:T | dream:ORDER")
    a = ap.parse_args()
    model = Model(a.model_dir)
    prompt = [int(t) for t in a.prompt.split(",")]
    if a.schedule.startswith("dream:"):
        out = dream_sampler(model, prompt, a.gen, a.steps, a.schedule.split(":")[1])
    else:
        out = semi_ar(model, prompt, a.gen, a.block, a.steps, a.schedule)
    print(out)


if __name__ == "__main__":
    main()
