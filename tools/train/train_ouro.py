#!/usr/bin/env python3
"""Trains a tiny Ouro-architecture looped LM and exports it in the HF layout Ponder loads.

Architecture (as ByteDance's Ouro): L decoder layers applied `loops` times, sandwich norm (4
RMSNorms per layer), split-half RoPE, the final norm after every loop, an exit-gate logit per
loop, untied LM head. Objective (Ouro stage I): for every token, the expected next-token loss
under the exit distribution minus beta times its entropy,

    p(t) = λ_t Π_{j<t} (1 − λ_j)  (t < T),   p(T) = Π_{j<T} (1 − λ_j),   λ_t = sigmoid(z_t)
    loss = Σ_t p(t) · CE(head(h_t), next) − β · H(p)

so the gate learns when the loop may stop. Seeds are fixed; the loss curve is printed and
written with all arguments to OUT/training.json.

    python3 tools/train/make_corpus.py                       # corpus/train.txt, corpus/heldout.txt
    python3 tools/train/make_tokenizer.py                    # corpus/tokenizer.json
    python3 tools/train/train_ouro.py --corpus corpus --tokenizer corpus/tokenizer.json \
        --out assets/tiny-ouro --minutes 8
    python3 tools/train/train_ouro.py --smoke --out /tmp/ouro-smoke    # CPU, 20 steps, ~1 minute

Every --eval-every steps the full-depth (last loop) cross-entropy on the first --eval-seqs
held-out windows is measured; the exported weights are those with the best of these (the last
weights included; --no-keep-best exports the last weights). The first GPU-trained model overfit:
its held-out perplexity rose with depth and over the last minutes of training.
"""
import argparse
import json
import math
import pathlib
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(t, d, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def rope(x, cos, sin):  # x [B, H, T, D]
    d = x.shape[-1]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i, nh, hd = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["head_dim"]
        self.nh, self.hd = nh, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nh * hd, bias=False)
        self.v_proj = nn.Linear(h, nh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        eps = c["rms_norm_eps"]
        self.input_layernorm, self.input_layernorm_2 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm, self.post_attention_layernorm_2 = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        a = self.input_layernorm(x)
        q, k, v = (p(a).view(b, t, self.nh, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.input_layernorm_2(self.o_proj(o.transpose(1, 2).reshape(b, t, -1)))
        m = self.post_attention_layernorm(x)
        return x + self.post_attention_layernorm_2(self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)))


class TinyOuro(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.early_exit_gate = nn.Linear(c["hidden_size"], 1)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.early_exit_gate.bias)

    def forward(self, ids):
        """Per-loop logits [T_loops, B, S, V] and gate logits [T_loops, B, S]."""
        cos, sin = rope_tables(ids.shape[1], self.c["head_dim"], self.c["rope_theta"], ids.device)
        h = self.embed_tokens(ids)
        logits, gates = [], []
        for _ in range(self.c["total_ut_steps"]):
            for layer in self.layers:
                h = layer(h, cos, sin)
            h = self.norm(h)
            logits.append(self.lm_head(h))
            gates.append(self.early_exit_gate(h).squeeze(-1))
        return torch.stack(logits), torch.stack(gates)


def exit_pdf(gate_logits):
    """p(t) over loops from per-loop hazards, the last loop taking the remaining mass."""
    lam = torch.sigmoid(gate_logits.float())
    survive = torch.cumprod(1 - lam, 0)
    prev = torch.cat([torch.ones_like(survive[:1]), survive[:-1]], 0)
    pdf = lam * prev
    return torch.cat([pdf[:-1], prev[-1:]], 0)


def ouro_loss(logits, gate_logits, targets, beta):
    t = logits.shape[0]
    ce = torch.stack([F.cross_entropy(logits[i].flatten(0, 1).float(), targets.flatten(), reduction="none") for i in range(t)])
    ce = ce.view(t, *targets.shape)
    p = exit_pdf(gate_logits)
    entropy = -(p * p.clamp_min(1e-9).log()).sum(0)
    return ((p * ce).sum(0) - beta * entropy).mean(), ce.mean(dim=(1, 2)), p.mean(dim=(1, 2))


def batches(ids, batch, seq, gen, device):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq + 1] for s in starts]).to(device)
        yield x[:, :-1], x[:, 1:]


def export(model, cfg, tokenizer_path, out):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        # HF names: model.layers.{i}.self_attn.* / .mlp.* / the four norms; lm_head outside model.
        parts = name.split(".")
        if parts[0] == "layers":
            group = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                     "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}.get(parts[2])
            if group:
                parts.insert(2, group)
        key = ".".join(parts) if parts[0] == "lm_head" else "model." + ".".join(parts)
        tensors[key] = p.detach().to(torch.bfloat16).contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"))
    conf = dict(cfg, architectures=["OuroForCausalLM"], model_type="ouro", tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg["eos_token_id"]]}))
    if pathlib.Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
        shutil.copy(tokenizer_path, out / "tokenizer.json")


def heldout_ce(model, x, y, device, autocast, loops, chunk=32):
    """Mean next-token cross-entropy per loop over held-out windows x -> y (in chunks: the
    per-loop logits of all of them at once are GBs)."""
    was_training = model.training
    model.eval()
    ce_sum = torch.zeros(loops, dtype=torch.float64)
    with torch.no_grad(), autocast:
        for i in range(0, len(x), chunk):
            logits, _ = model(x[i : i + chunk].to(device))
            yy = y[i : i + chunk].to(device).flatten()
            ce_sum += torch.tensor([F.cross_entropy(logits[j].flatten(0, 1).float(), yy, reduction="sum").item() for j in range(loops)], dtype=torch.float64)
    model.train(was_training)
    return (ce_sum / y.numel()).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="corpus")
    ap.add_argument("--tokenizer", default="corpus/tokenizer.json")
    ap.add_argument("--out", default="out/tiny-ouro")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--beta", type=float, default=0.3)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations (keep-best)")
    ap.add_argument("--eval-seqs", type=int, default=64, help="held-out windows per periodic evaluation")
    ap.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                    help="export the last weights instead of those with the best periodic full-depth held-out CE")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: 20 steps (at most 2 minutes) --batch 8, held-out on 16 sequences")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.max_steps, args.batch, args.log_every = min(args.minutes, 2.0), min(args.max_steps, 20), 8, 5
        args.eval_every, args.eval_seqs = 10, 8

    torch.manual_seed(args.seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    tok = Tokenizer.from_file(args.tokenizer)
    eos_id = tok.token_to_id("<|endoftext|>")
    assert eos_id is not None, "the tokenizer has no <|endoftext|>"
    corpus = pathlib.Path(args.corpus)
    train_ids = torch.tensor(tok.encode((corpus / "train.txt").read_text()).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode((corpus / "heldout.txt").read_text()).ids, dtype=torch.long)
    print(f"device {device}; {len(train_ids)} training tokens, {len(held_ids)} held-out tokens")
    cfg = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": 2048,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "total_ut_steps": args.loops,
        "eos_token_id": eos_id,
    }
    model = TinyOuro(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen, device)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    xs = held_ids[: (len(held_ids) - 1) // args.seq * args.seq + 1]
    held_x, held_y = xs[:-1].view(-1, args.seq), xs[1:].view(-1, args.seq)
    if args.smoke:
        held_x, held_y = held_x[:16], held_y[:16]
    eval_x, eval_y = held_x[: args.eval_seqs], held_y[: args.eval_seqs]
    best = (float("inf"), None, -1)  # full-depth held-out CE, CPU copy of the weights, step
    evals = []
    curve, start, step = [], time.time(), 0
    budget = args.minutes * 60
    while step < args.max_steps and time.time() - start < budget:
        frac = (time.time() - start) / budget
        for g in opt.param_groups:  # warm-up, then cosine decay over the time budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        x, y = next(data)
        with autocast:
            logits, gates = model(x)
        loss, ce_per_loop, p_mean = ouro_loss(logits, gates, y, args.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            row = {"step": step, "seconds": round(time.time() - start, 1), "loss": loss.item(),
                   "ce_per_loop": [round(v, 4) for v in ce_per_loop.tolist()], "exit_pdf": [round(v, 3) for v in p_mean.tolist()]}
            curve.append(row)
            print(json.dumps(row), flush=True)
        step += 1
        if args.eval_every > 0 and step % args.eval_every == 0:
            ce = heldout_ce(model, eval_x, eval_y, device, autocast, args.loops)
            evals.append({"step": step, "seconds": round(time.time() - start, 1), "heldout_ce_per_loop": [round(c, 4) for c in ce]})
            print(json.dumps(evals[-1]), flush=True)
            if args.keep_best and ce[-1] < best[0]:
                best = (ce[-1], {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)

    train_seconds = time.time() - start
    print(f"{step} steps in {train_seconds:.1f} s ({step / train_seconds:.2f} steps/s)")
    exported_step = step
    if args.keep_best:  # the last weights compete with the best periodic ones
        last = heldout_ce(model, eval_x, eval_y, device, autocast, args.loops)[-1]
        print(f"last weights: full-depth held-out CE {last:.4f}; best periodic {best[0]:.4f} at step {best[2]}")
        if best[1] is not None and best[0] < last:
            model.load_state_dict(best[1])
            exported_step = best[2]
            print(f"exporting the weights of step {exported_step}")
    model.eval()
    ce = heldout_ce(model, held_x, held_y, device, autocast, args.loops)
    print("held-out perplexity per loop (full depth = last):", [round(math.exp(c), 2) for c in ce])
    out = pathlib.Path(args.out)
    export(model.float(), cfg, args.tokenizer, out)
    (out / "training.json").write_text(json.dumps({"args": vars(args), "device": device, "steps": step, "train_seconds": round(train_seconds, 1),
                                                   "steps_per_second": step / train_seconds, "curve": curve,
                                                   "periodic_evals": evals, "exported_step": exported_step,
                                                   "heldout_ppl_per_loop": [math.exp(c) for c in ce]}))
    print(f"exported to {out} after {step} steps")


if __name__ == "__main__":
    main()
