#!/usr/bin/env python3
"""Trains a tiny SDAR-architecture block-diffusion LM and exports it in the HF layout Ponder loads.

Architecture (as JetAstra/SDAR, Qwen3 layout): token embedding; L pre-norm layers, each
input_layernorm -> attention (q/k/v/o projections without bias, per-head q_norm/k_norm RMSNorm
over head_dim applied before split-half "rotate_half" RoPE, grouped-query heads) -> residual,
post_attention_layernorm -> SwiGLU MLP (down(silu(gate(x)) * up(x))) -> residual; final norm;
untied LM head. RMSNorm eps 1e-6, statistics in fp32. Attention is BLOCK-CAUSAL with block
length B: a token attends to every token of its own block and of all earlier blocks. No logit
shift: the logits at a position predict the token AT that position.

Objective (block diffusion, BD3-LM/SDAR style), with the two-stream trick: the model input is
[x_noisy ‖ x_clean] (length 2T, both streams at positions 0..T-1). Noisy block b attends to noisy
block b (bidirectionally) and to clean blocks < b; clean block b attends to clean blocks <= b
(so clean K/V are exactly what inference caches). For every sequence s and block b a noise
level t_{s,b} ~ U(eps, 1) is drawn and each token of the noisy block is replaced by `<|mask|>`
independently with probability t_{s,b}. With M the set of masked positions of the batch and
CE_i the cross entropy of the noisy-stream logits at i against the clean token at i,

    loss = ( Σ_{i∈M} CE_i / t_{b(i)} ) / max(|M|, 1)

i.e. the 1/t-weighted cross entropy averaged over the masked tokens of the whole batch
(unmasked positions and the clean stream carry no loss). The unweighted masked CE is logged too.

Seeds are fixed; the loss curve (and a held-out masked CE at mask ratio 0.5 every --eval-every
steps) is printed and written with all arguments to OUT/training.json. The exported weights are
those with the best of these held-out CEs (the last weights included; --no-keep-best exports the
last ones), which guards the small corpus against overfitting. At the end: held-out
masked-token CE/accuracy at mask ratios 0.15/0.5/0.85/1.0, export (model.safetensors in bf16,
config.json, generation_config.json, tokenizer.json), and with --check a reload of the export
through the independent float64 reference tools/reference/sdar_ref.py.

    python3 tools/train/make_corpus.py && python3 tools/train/make_tokenizer.py
    python3 tools/train/train_sdar.py --corpus corpus --tokenizer corpus/tokenizer.json \\
        --out assets/tiny-sdar --minutes 8 --check
    python3 tools/train/train_sdar.py --smoke --out /tmp/sdar-smoke     # CPU, ~1 minute
"""
import argparse
import json
import math
import pathlib
import shutil
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

EVAL_RATIOS = (0.15, 0.5, 0.85, 1.0)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(positions, d, theta):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def rope(x, cos, sin):  # x [B, H, T, D], split-half ("rotate_half") convention
    d = x.shape[-1]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def block_causal_mask(t, block, device):
    """[t, t] bool, True = may attend: key block <= query block (one canvas, inference view)."""
    b = torch.arange(t, device=device) // block
    return b[None, :] <= b[:, None]


def two_stream_mask(t, block, device):
    """[2t, 2t] bool for [x_noisy ‖ x_clean]: noisy→(same noisy block, clean blocks < own),
    clean→(clean blocks <= own), clean never sees noisy."""
    b = torch.arange(t, device=device) // block
    qb, kb = b[:, None], b[None, :]
    noisy_noisy = qb == kb
    noisy_clean = kb < qb
    clean_clean = kb <= qb
    top = torch.cat([noisy_noisy, noisy_clean], 1)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], 1)
    return torch.cat([top, bottom], 0)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.nh, self.nkv, self.hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.hd, c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin).to(v.dtype), rope(k, cos, sin).to(v.dtype)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TinySDAR(nn.Module):
    """Parameter names are the HF names (model.layers.{i}.self_attn.q_proj.weight, ...)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Backbone(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids, positions, mask, logits_upto=None):
        """ids [B, S], positions [S], mask [S, S] bool (True = attend). Logits [B, logits_upto or S, V]."""
        cos, sin = rope_tables(positions, self.c["head_dim"], self.c["rope_theta"])
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        if logits_upto is not None:
            h = h[:, :logits_upto]
        return self.lm_head(self.model.norm(h))

    def forward_two_stream(self, noisy, clean):
        """Noisy-stream logits [B, T, V] for input [noisy ‖ clean]."""
        t = noisy.shape[1]
        pos = torch.arange(t, device=noisy.device)
        mask = two_stream_mask(t, self.c["block_size"], noisy.device)
        return self.forward(torch.cat([noisy, clean], 1), torch.cat([pos, pos]), mask, logits_upto=t)

    def forward_canvas(self, ids):
        """One canvas with block-causal attention (the inference view): logits [B, S, V]."""
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        return self.forward(ids, pos, block_causal_mask(s, self.c["block_size"], ids.device))


def noise(x, block, mask_id, eps, gen, ratio=None):
    """Per (sequence, block) t ~ U(eps, 1) (or the fixed `ratio`); each token masked with prob t.
    Returns noisy ids, the bool mask and t per token (all on x's device)."""
    b, t = x.shape
    nb = (t + block - 1) // block
    if ratio is None:
        tb = eps + (1 - eps) * torch.rand(b, nb, generator=gen)
    else:
        tb = torch.full((b, nb), float(ratio))
    tt = tb.repeat_interleave(block, dim=1)[:, :t]
    masked = torch.rand(b, t, generator=gen) < tt
    tt, masked = tt.to(x.device), masked.to(x.device)
    return torch.where(masked, torch.full_like(x, mask_id), x), masked, tt


def diffusion_loss(logits, x, masked, tt):
    """(Σ_{masked} CE/t) / max(#masked, 1) and the unweighted masked CE (for logging)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten(), reduction="none").view(x.shape)
    n = masked.sum().clamp_min(1)
    m = masked.float()
    return (ce * m / tt).sum() / n, ((ce * m).sum() / n).detach()


def batches(ids, batch, seq, gen, device):
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq] for s in starts]).to(device)


@torch.no_grad()
def evaluate(model, held_ids, cfg, seq, device, autocast, ratios, max_windows=None, batch=64, seed=1234):
    """Held-out masked-token CE and accuracy at fixed mask ratios (every noisy block masked with
    probability `ratio` per token, clean earlier blocks as context). Deterministic."""
    was_training = model.training
    model.eval()
    n = len(held_ids) // seq
    if max_windows:
        n = min(n, max_windows)
    windows = held_ids[: n * seq].view(n, seq)
    out = {}
    for r in ratios:
        gen = torch.Generator().manual_seed(seed)
        ce_sum, correct, count = 0.0, 0, 0
        for i in range(0, n, batch):
            x = windows[i : i + batch].to(device)
            noisy, masked, _ = noise(x, cfg["block_size"], cfg["mask_token_id"], 0.0, gen, ratio=r)
            with autocast:
                logits = model.forward_two_stream(noisy, x)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten(), reduction="none").view(x.shape)
            ce_sum += (ce * masked).sum().item()
            correct += ((logits.argmax(-1) == x) & masked).sum().item()
            count += masked.sum().item()
        out[str(r)] = {"ce": ce_sum / max(count, 1), "acc": correct / max(count, 1), "masked_tokens": count}
    model.train(was_training)
    return out


def export(model, cfg, tokenizer_path, out, args):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_theta": cfg["rope_theta"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": cfg["block_size"],
        "mask_token_id": cfg["mask_token_id"],
        "bos_token_id": cfg["eos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    gen = {
        "bos_token_id": cfg["eos_token_id"],
        "eos_token_id": [cfg["eos_token_id"]],
        "mask_token_id": cfg["mask_token_id"],
        "block_length": cfg["block_size"],
        "denoising_steps": cfg["block_size"],
        "threshold": args.threshold,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if pathlib.Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
        shutil.copy(tokenizer_path, out / "tokenizer.json")


def check_export(model, cfg, out, held_ids, seed):
    """The exported (bf16) weights reloaded by the independent float64 reference must agree with
    this trainer's forward (float32, same bf16-rounded weights): one canvas with block-causal
    attention, and the two-stream training view against the equivalent canvas."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "reference"))
    from sdar_ref import SDARReference

    ref = SDARReference(out)
    m = TinySDAR(cfg)
    m.load_state_dict({k: v.detach().to(torch.bfloat16).float().cpu() for k, v in model.state_dict().items()})
    m.eval()
    bs, mask_id = cfg["block_size"], cfg["mask_token_id"]
    g = torch.Generator().manual_seed(seed)
    x = held_ids[: 5 * bs - 3].clone()  # ragged last block
    canvas = x.clone()
    canvas[3 * bs + 2 :: 2] = mask_id  # masks in the last two blocks
    with torch.no_grad():
        mine = m.forward_canvas(canvas[None])[0].double()
    theirs = ref.forward(canvas.tolist())
    diff_canvas = (mine - theirs).abs().max().item()
    # Two-stream: noisy block b's logits == the canvas [clean blocks < b, noisy block b].
    xs = held_ids[: 4 * bs][None]
    noisy, masked, _ = noise(xs, bs, mask_id, 1e-3, g, ratio=0.5)
    with torch.no_grad():
        two = m.forward_two_stream(noisy, xs)[0, 3 * bs :].double()
    canvas2 = torch.cat([xs[0, : 3 * bs], noisy[0, 3 * bs :]])
    ref2 = ref.forward(canvas2.tolist())[3 * bs :]
    diff_two = (two - ref2).abs().max().item()
    print(f"check: max |logit diff| trainer(f32) vs sdar_ref(f64) on the export: canvas {diff_canvas:.2e}, "
          f"two-stream vs canvas {diff_two:.2e} (must be < 1e-3)")
    return {"canvas_max_abs_diff": diff_canvas, "two_stream_max_abs_diff": diff_two}


@torch.no_grad()
def device_check(model, cfg, held_ids, seq, device):
    """The trained model's two-stream forward on the training device (float32, no autocast) must
    match the same weights on the CPU: catches an attention kernel that mishandles the mask."""
    cpu = TinySDAR(cfg)
    cpu.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    x = held_ids[: 2 * seq].view(2, seq)
    noisy, _, _ = noise(x, cfg["block_size"], cfg["mask_token_id"], 0.0, torch.Generator().manual_seed(7), ratio=0.5)
    a = cpu.forward_two_stream(noisy, x)
    b = model.float().forward_two_stream(noisy.to(device), x.to(device)).cpu()
    diff = (a - b).abs().max().item()
    print(f"check: {device} vs cpu float32 two-stream logits, max |diff| {diff:.2e} (must be < 2e-2)")
    return diff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="corpus")
    ap.add_argument("--tokenizer", default="corpus/tokenizer.json")
    ap.add_argument("--out", default="out/tiny-sdar")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (a multiple of --block)")
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1)")
    ap.add_argument("--threshold", type=float, default=0.9, help="written to generation_config.json")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall budget of the training loop")
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (cuda)")
    ap.add_argument("--check", action="store_true", help="reload the export with tools/reference/sdar_ref.py and compare")
    ap.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                    help="export the last weights instead of those with the best periodic held-out CE@0.5")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: 20 steps (at most 2 minutes) --batch 8, eval on 16 windows, --check")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.max_steps, args.batch, args.log_every, args.eval_every, args.check = min(args.minutes, 2.0), min(args.max_steps, 20), 8, 5, 10, True
    assert args.seq % args.block == 0, "--seq must be a multiple of --block"

    torch.manual_seed(args.seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    tok = Tokenizer.from_file(args.tokenizer)
    eos_id, mask_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|mask|>")
    assert eos_id is not None and mask_id is not None, "the tokenizer needs <|endoftext|> and <|mask|> (tools/train/make_tokenizer.py)"
    corpus = pathlib.Path(args.corpus)
    train_ids = torch.tensor(tok.encode((corpus / "train.txt").read_text()).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode((corpus / "heldout.txt").read_text()).ids, dtype=torch.long)
    print(f"device {device}; {len(train_ids)} training tokens, {len(held_ids)} held-out tokens; eos {eos_id}, mask {mask_id}")
    cfg = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_positions,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": 1e-6,
        "block_size": args.block,
        "mask_token_id": mask_id,
        "eos_token_id": eos_id,
    }
    model = TinySDAR(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters; bf16 export ≈ {2 * n_params / 2**20:.1f} MiB")
    fwd = torch.compile(model.forward_two_stream) if args.compile else model.forward_two_stream
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen, device)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    eval_windows = 16 if args.smoke else None
    curve, evals, start, step = [], [], time.time(), 0
    best = (float("inf"), None, -1)  # held-out CE@0.5, CPU copy of the weights, step
    budget = args.minutes * 60
    while step < args.max_steps and time.time() - start < budget:
        frac = max((time.time() - start) / budget, step / args.max_steps)
        for g in opt.param_groups:  # warm-up, then cosine decay over the time (or step) budget
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        x = next(data)
        noisy, masked, tt = noise(x, args.block, mask_id, args.eps, gen)
        with autocast:
            logits = fwd(noisy, x)
        loss, ce = diffusion_loss(logits, x, masked, tt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            row = {"step": step, "seconds": round(time.time() - start, 1), "loss": round(loss.item(), 4),
                   "masked_ce": round(ce.item(), 4), "grad_norm": round(gnorm.item(), 3), "lr": round(opt.param_groups[0]["lr"], 6)}
            curve.append(row)
            print(json.dumps(row), flush=True)
        if step > 0 and step % args.eval_every == 0:
            e = evaluate(model, held_ids, cfg, args.seq, device, autocast, (0.5,), max_windows=eval_windows)["0.5"]
            evals.append({"step": step, "seconds": round(time.time() - start, 1), "heldout_ce@0.5": round(e["ce"], 4), "heldout_acc@0.5": round(e["acc"], 4)})
            print(json.dumps(evals[-1]), flush=True)
            if args.keep_best and e["ce"] < best[0]:
                best = (e["ce"], {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)
        step += 1
    train_seconds = time.time() - start
    print(f"{step} steps in {train_seconds:.1f} s ({step / train_seconds:.2f} steps/s, "
          f"{step * args.batch * args.seq / train_seconds:.0f} tokens/s)")
    if args.keep_best:  # the last weights compete with the best periodic ones
        e = evaluate(model, held_ids, cfg, args.seq, device, autocast, (0.5,), max_windows=eval_windows)["0.5"]
        print(f"last weights: held-out CE@0.5 {e['ce']:.4f}; best periodic {best[0]:.4f} at step {best[2]}")
        if best[1] is not None and best[0] < e["ce"]:
            model.load_state_dict(best[1])
            print(f"exporting the weights of step {best[2]}")
        else:
            best = (e["ce"], None, step)
    exported_step = best[2] if args.keep_best else step

    final = evaluate(model, held_ids, cfg, args.seq, device, autocast, EVAL_RATIOS, max_windows=eval_windows if args.smoke else None)
    for r, e in final.items():
        print(f"held-out mask ratio {r}: masked-token CE {e['ce']:.4f} (ppl {math.exp(e['ce']):.1f}), accuracy {e['acc']:.4f} over {e['masked_tokens']} tokens")
    out = pathlib.Path(args.out)
    export(model, cfg, args.tokenizer, out, args)
    record = {
        "args": vars(args), "config": cfg, "parameters": n_params, "device": device,
        "torch": torch.__version__, "steps": step, "train_seconds": round(train_seconds, 1),
        "steps_per_second": step / train_seconds, "tokens_seen": step * args.batch * args.seq,
        "training_tokens": len(train_ids), "heldout_tokens": len(held_ids),
        "exported_step": exported_step, "curve": curve, "heldout_curve": evals, "heldout_final": final,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"exported to {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB): weights of step {exported_step} of {step}")
    if args.check:  # after the export, so a failing check never loses the trained model
        dev_diff = device_check(model, cfg, held_ids, args.seq, device) if device != "cpu" else None
        check = check_export(model.float().cpu(), cfg, out, held_ids, args.seed)
        record.update(check=check, device_vs_cpu_max_abs_diff=dev_diff)
        (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        assert check["canvas_max_abs_diff"] < 1e-3 and check["two_stream_max_abs_diff"] < 1e-3, check
        assert dev_diff is None or dev_diff < 2e-2, dev_diff
        print("checks passed")


if __name__ == "__main__":
    main()
