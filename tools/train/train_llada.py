#!/usr/bin/env python3
"""Trains a tiny LLaDA-architecture masked-diffusion LM (bidirectional) on the tiny SDAR's corpus
and tokenizer, and exports it in the released LLaDA layout Ponder loads.

Architecture (as GSAI-ML/LLaDA, OLMo-style names `model.transformer.*`): token embedding `wte`;
L pre-norm blocks, each attn_norm -> attention (q/k/v projections without bias, split-half RoPE,
grouped-query heads, **bidirectional**: every token sees the whole sequence) -> attn_out ->
residual, ff_norm -> SwiGLU (ff_out(silu(ff_proj(x)) * up_proj(x))) -> residual; final ln_f;
untied head `model.transformer.ff_out`. RMSNorm eps 1e-5, statistics in fp32. No logit shift.

Objective (LLaDA's masked diffusion): per sequence t ~ U(eps, 1); each token replaced by
`<|mask|>` independently with probability t; loss = (Σ_{masked} CE / t) / max(#masked, 1) over
the batch (the same weighting as train_sdar.py). Layers, optimiser, schedule, best-checkpoint
selection and the held-out evaluation (masked-token CE / accuracy at fixed mask ratios, the whole
sequence visible) follow train_sdar.py; helpers are imported from it.

    python3 tools/train/make_corpus.py --out corpus
    python3 tools/train/train_llada.py --corpus corpus --tokenizer assets/tiny-sdar/tokenizer.json \\
        --out assets/tiny-llada --minutes 5 --check
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_sdar import RMSNorm, batches, diffusion_loss, rope, rope_tables  # noqa: E402

EVAL_RATIOS = (0.15, 0.5, 0.85, 1.0)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.nh, self.nkv, self.hd = c["d_model"], c["n_heads"], c["n_kv_heads"], c["head_dim"]
        self.attn_norm = RMSNorm(h, c["rms_norm_eps"])
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.attn_out = nn.Linear(self.nh * self.hd, h, bias=False)
        self.ff_norm = RMSNorm(h, c["rms_norm_eps"])
        self.ff_proj = nn.Linear(h, c["mlp_hidden_size"], bias=False)
        self.up_proj = nn.Linear(h, c["mlp_hidden_size"], bias=False)
        self.ff_out = nn.Linear(c["mlp_hidden_size"], h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.q_proj(y).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin).to(v.dtype), rope(k, cos, sin).to(v.dtype)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        x = x + self.attn_out(o.transpose(1, 2).reshape(b, t, -1))
        y = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(y)) * self.up_proj(y))


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.ln_f = RMSNorm(c["d_model"], c["rms_norm_eps"])
        self.ff_out = nn.Linear(c["d_model"], c["vocab_size"], bias=False)


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = Transformer(c)


class TinyLLaDA(nn.Module):
    """Parameter names are the released names (model.transformer.blocks.{i}.q_proj.weight, ...)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids):
        """ids [B, S] -> logits [B, S, V], every token attending to the whole sequence."""
        tr = self.model.transformer
        cos, sin = rope_tables(torch.arange(ids.shape[1], device=ids.device), self.c["head_dim"], self.c["rope_theta"])
        h = tr.wte(ids)
        for block in tr.blocks:
            h = block(h, cos, sin)
        return tr.ff_out(tr.ln_f(h))


def noise(x, mask_id, eps, gen, ratio=None):
    """Per sequence t ~ U(eps, 1) (or the fixed `ratio`); each token masked with probability t."""
    b, t = x.shape
    ts = eps + (1 - eps) * torch.rand(b, 1, generator=gen) if ratio is None else torch.full((b, 1), float(ratio))
    tt = ts.expand(b, t)
    masked = torch.rand(b, t, generator=gen) < tt
    tt, masked = tt.to(x.device), masked.to(x.device)
    return torch.where(masked, torch.full_like(x, mask_id), x), masked, tt


@torch.no_grad()
def evaluate(model, held_ids, cfg, seq, device, autocast, ratios, max_windows=None, batch=64, seed=1234):
    """Held-out masked-token CE and accuracy at fixed mask ratios. Deterministic."""
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
            noisy, masked, _ = noise(x, cfg["mask_token_id"], 0.0, gen, ratio=r)
            with autocast:
                logits = model(noisy)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten(), reduction="none").view(x.shape)
            ce_sum += (ce * masked).sum().item()
            correct += ((logits.argmax(-1) == x) & masked).sum().item()
            count += masked.sum().item()
        out[str(r)] = {"ce": ce_sum / max(count, 1), "acc": correct / max(count, 1), "masked_tokens": count}
    model.train(was_training)
    return out


def export(model, cfg, tokenizer_path, out):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": cfg["d_model"],
        "n_layers": cfg["n_layers"],
        "n_heads": cfg["n_heads"],
        "n_kv_heads": cfg["n_kv_heads"],
        "mlp_hidden_size": cfg["mlp_hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "embedding_size": cfg["vocab_size"],
        "max_sequence_length": cfg["max_sequence_length"],
        "rope_theta": cfg["rope_theta"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "weight_tying": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rope": True,
        "alibi": False,
        "attention_layer_norm": False,
        "mask_token_id": cfg["mask_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["eos_token_id"],
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg["eos_token_id"]], "mask_token_id": cfg["mask_token_id"]}, indent=2) + "\n")
    if pathlib.Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
        shutil.copy(tokenizer_path, out / "tokenizer.json")


def check_export(model, cfg, out, held_ids):
    """The export (bf16) reloaded by the independent float64 reference must agree with this
    trainer's forward (float32, the same bf16-rounded weights) on a canvas with masks."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "reference"))
    from bidirectional_ref import Model

    ref = Model(out)
    m = TinyLLaDA(cfg)
    m.load_state_dict({k: v.detach().to(torch.bfloat16).float().cpu() for k, v in model.state_dict().items()})
    m.eval()
    canvas = held_ids[:77].clone()
    canvas[40::3] = cfg["mask_token_id"]
    with torch.no_grad():
        mine = m(canvas[None])[0].double().numpy()
    theirs = ref.logits(canvas.tolist())
    diff = float(abs(mine - theirs).max())
    print(f"check: max |logit diff| trainer(f32) vs bidirectional_ref(f64) on the export: {diff:.2e} (must be < 1e-3)")
    return diff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="corpus")
    ap.add_argument("--tokenizer", default="assets/tiny-sdar/tokenizer.json")
    ap.add_argument("--out", default="out/tiny-llada")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1)")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall budget of the training loop")
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--check", action="store_true", help="reload the export with tools/reference/bidirectional_ref.py and compare")
    ap.add_argument("--smoke", action="store_true", help="20 steps, --batch 8, eval on 16 windows, --check")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.max_steps, args.batch, args.log_every, args.eval_every, args.check = min(args.minutes, 2.0), min(args.max_steps, 20), 8, 5, 10, True

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = Tokenizer.from_file(args.tokenizer)
    eos_id, mask_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|mask|>")
    assert eos_id is not None and mask_id is not None, "the tokenizer needs <|endoftext|> and <|mask|>"
    corpus = pathlib.Path(args.corpus)
    train_ids = torch.tensor(tok.encode((corpus / "train.txt").read_text()).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode((corpus / "heldout.txt").read_text()).ids, dtype=torch.long)
    print(f"device {device}; {len(train_ids)} training tokens, {len(held_ids)} held-out tokens; eos {eos_id}, mask {mask_id}")
    cfg = {
        "vocab_size": tok.get_vocab_size(), "d_model": args.hidden, "mlp_hidden_size": args.intermediate,
        "n_layers": args.layers, "n_heads": args.heads, "n_kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "max_sequence_length": args.max_positions, "rope_theta": args.rope_theta, "rms_norm_eps": 1e-5,
        "mask_token_id": mask_id, "eos_token_id": eos_id,
    }
    assert args.hidden == args.heads * args.head_dim, "LLaDA's config has no head_dim: d_model = n_heads × head_dim"
    model = TinyLLaDA(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters; bf16 export ≈ {2 * n_params / 2**20:.1f} MiB")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen, device)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    eval_windows = 16 if args.smoke else None
    curve, evals, start, step = [], [], time.time(), 0
    best = (float("inf"), None, -1)
    budget = args.minutes * 60
    while step < args.max_steps and time.time() - start < budget:
        frac = max((time.time() - start) / budget, step / args.max_steps)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        x = next(data)
        noisy, masked, tt = noise(x, mask_id, args.eps, gen)
        with autocast:
            logits = model(noisy)
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
            if e["ce"] < best[0]:
                best = (e["ce"], {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)
        step += 1
    train_seconds = time.time() - start
    print(f"{step} steps in {train_seconds:.1f} s ({step / train_seconds:.2f} steps/s)")
    e = evaluate(model, held_ids, cfg, args.seq, device, autocast, (0.5,), max_windows=eval_windows)["0.5"]
    print(f"last weights: held-out CE@0.5 {e['ce']:.4f}; best periodic {best[0]:.4f} at step {best[2]}")
    if best[1] is not None and best[0] < e["ce"]:
        model.load_state_dict(best[1])
        print(f"exporting the weights of step {best[2]}")
    else:
        best = (e["ce"], None, step)
    final = evaluate(model, held_ids, cfg, args.seq, device, autocast, EVAL_RATIOS, max_windows=eval_windows)
    for r, f in final.items():
        print(f"held-out mask ratio {r}: masked-token CE {f['ce']:.4f} (ppl {math.exp(f['ce']):.1f}), accuracy {f['acc']:.4f} over {f['masked_tokens']} tokens")
    out = pathlib.Path(args.out)
    export(model, cfg, args.tokenizer, out)
    record = {
        "args": vars(args), "config": cfg, "parameters": n_params, "device": device, "torch": torch.__version__,
        "steps": step, "train_seconds": round(train_seconds, 1), "tokens_seen": step * args.batch * args.seq,
        "training_tokens": len(train_ids), "heldout_tokens": len(held_ids), "exported_step": best[2],
        "curve": curve, "heldout_curve": evals, "heldout_final": final,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"exported to {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB): weights of step {best[2]} of {step}")
    if args.check:
        record["check_max_abs_diff"] = check_export(model.float().cpu(), cfg, out, held_ids)
        (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        assert record["check_max_abs_diff"] < 1e-3, record["check_max_abs_diff"]
        print("checks passed")


if __name__ == "__main__":
    main()
