#!/usr/bin/env python3
"""Trains the CDB authors' lookahead and preloop exit-gate heads for any Ouro checkpoint
(recipe: ../../shared/spec/lookahead-gate.md §1; Ponder serves the heads as
`gate::LearnedLookahead` and `gate::Preloop`).

The checkpoint is frozen. Its own exit gate is the teacher: a teacher-forced full-depth forward
gives the normed loop outputs h_0..h_{T-1}, the stock gate logits z_0..z_{T-1} (hazards
λ_r = sigmoid(z_r)) and the token embeddings (Ouro's prelude output).

- lookahead head (Linear(H, 1), initialised from the stock gate): reads h_r and predicts the stock
  hazard of step r + 1. Loss = BCE-with-logits against the soft targets sigmoid(z_{r+1}) for
  r = 0..T-3, plus the mean |CDF_student - CDF_teacher| over depths, both pdfs folded to the
  minimum depth 2 that a verdict consumed one step late allows.
- preloop head (Linear(H, T)): reads the embedding and gives a distribution over depths 1..T.
  Loss = KL(teacher pdf || softmax) + mean |ΔCDF| (teacher pdf unfolded).

Defaults are the authors': AdamW (lr 1e-3, weight decay 0.01, one optimiser per head), 500
linear warm-up steps then cosine to 5 %, gradient clip 1.0 per head, 20 000 steps of one packed
4096-token sequence, seed 79, validation every 500 steps and at step 0.

Corpus: a plain-text file (cut into --window-token documents; every position is in the loss, a
deviation from the authors' assistant-only loss that the JSON records), or a `.jsonl` of chat
records `{"text": rendered conversation, "assistant": [[start, end], ...]}` (character spans of
assistant text, e.g. from a chat template), where only positions whose next token is assistant
text are in the loss. Documents are packed into --seq-token sequences with positions restarting
per document and no attention across documents.

Writes OUT/lookahead_exit_gate.safetensors (weight [1, H], bias [1], f32),
OUT/preloop_exit_gate.safetensors (weight [T, H], bias [T], f32) and OUT/gate_training_config.json
(settings, data and checkpoint provenance, validation curve).

    python3 tools/train/train_gate.py --model assets/tiny-ouro --corpus corpus/train.txt \\
        --heldout corpus/heldout.txt --window 256 --dtype float32 --out assets/tiny-ouro/gates
    python3 tools/train/train_gate.py --model assets/tiny-ouro --corpus corpus/train.txt \\
        --heldout corpus/heldout.txt --window 256 --steps 20 --eval-every 10 --out /tmp/gates  # smoke
"""
import argparse
import hashlib
import json
import math
import pathlib
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "reference"))
from ouro_ref import OuroReference  # noqa: E402

AGREEMENT_QS = [0.1, 0.2, 0.25, 0.3, 0.5, 0.7]


class FrozenOuro(OuroReference):
    """Batched teacher-forced Ouro forward over packed documents (no grad): the reference's
    config and weights (in `dtype`, on `device`), with f32 norm statistics and SDPA."""

    def __init__(self, model_dir, dtype, device):
        if json.loads((model_dir / "config.json").read_text()).get("model_type") != "ouro":
            raise SystemExit(f"{model_dir}: not an Ouro checkpoint (model_type 'ouro')")
        super().__init__(model_dir, dtype)
        self.w = {k: v.to(device) for k, v in self.w.items()}
        self.layers = self.cfg["num_hidden_layers"]
        self.hidden = self.cfg["hidden_size"]
        self.device = device

    def rms(self, x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * weight

    def rope_tables(self, positions):
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        ang = positions.float()[..., None] * inv
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.dtype)[:, None]  # [B, 1, S, D]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(self.dtype)[:, None]
        return cos, sin

    @staticmethod
    def rotate(x, cos, sin):
        d = x.shape[-1]
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    def layer(self, i, h, cos, sin, mask):
        w, p = self.w, f"model.layers.{i}"
        b, s, _ = h.shape
        a = self.rms(h, w[f"{p}.input_layernorm.weight"])
        q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if mask is None:  # documents of one length, one per row: the fused causal kernels
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(b, s, -1)
        h = h + self.rms(attn @ w[f"{p}.self_attn.o_proj.weight"].T, w[f"{p}.input_layernorm_2.weight"])
        m = self.rms(h, w[f"{p}.post_attention_layernorm.weight"])
        m = (F.silu(m @ w[f"{p}.mlp.gate_proj.weight"].T) * (m @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[f"{p}.mlp.down_proj.weight"].T
        return h + self.rms(m, w[f"{p}.post_attention_layernorm_2.weight"])

    @torch.no_grad()
    def forward(self, ids, positions, docs, keep, doc_len=None):
        """ids, positions, docs: [B, S]; keep: [B, S] bool (positions in the loss). With
        `doc_len`, every sequence is whole documents of that length, run one per row.
        Returns, at the kept positions, the normed loop outputs [T, N, H] (f32), the stock gate
        logits [T, N] (f32) and the embeddings [N, H] (f32)."""
        if doc_len:
            ids, positions, keep = (x.reshape(-1, doc_len) for x in (ids, positions, keep))
            mask = None
        else:
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.device).tril()
            mask = (causal[None] & (docs[:, :, None] == docs[:, None, :]))[:, None]  # [B, 1, S, S]
        cos, sin = self.rope_tables(positions)
        emb = self.w["model.embed_tokens.weight"][ids]
        h, outs, gates = emb, [], []
        gw, gb = self.w["model.early_exit_gate.weight"].float(), self.w["model.early_exit_gate.bias"].float()
        for _ in range(self.steps):
            for i in range(self.layers):
                h = self.layer(i, h, cos, sin, mask)
            h = self.rms(h, self.w["model.norm.weight"])  # the final norm after every loop
            hk = h[keep].float()
            outs.append(hk)
            gates.append((hk @ gw.T + gb).squeeze(-1))
        return torch.stack(outs), torch.stack(gates), emb[keep].float()


def teacher_pdf(z):
    """Exit pdf over depths 1..T from stock gate logits z [T, N] (the last step takes the rest)."""
    lam = torch.sigmoid(z)
    t = z.shape[0]
    survive = torch.cumprod(torch.cat([torch.ones_like(lam[:1]), 1 - lam[:-1]]), 0)  # before step r
    pdf = lam * survive
    pdf[t - 1] = survive[t - 1]
    return pdf.T  # [N, T]


def lookahead_pdf(student_logits, t):
    """Student pdf over depths 1..T from predicted hazards μ_1..μ_{T-2} [T-2, N]: zero mass at
    depth 1 (a verdict consumed one step late), depth r + 1 gets μ_r of the survivors, depth T the rest."""
    mu = torch.sigmoid(student_logits)
    n = mu.shape[1]
    cols, survive = [torch.zeros(n, device=mu.device)], torch.ones(n, device=mu.device)
    for r in range(t - 2):
        cols.append(mu[r] * survive)
        survive = survive * (1 - mu[r])
    cols.append(survive)
    return torch.stack(cols, 1)


def fold_to_min_two(pdf):
    return torch.cat([torch.zeros_like(pdf[:, :1]), pdf[:, :1] + pdf[:, 1:2], pdf[:, 2:]], 1)


def cdf_l1(p, q):
    return (p.cumsum(1) - q.cumsum(1)).abs().mean()


def exit_depth(pdf, q, min_depth):
    """First depth (1-based) whose CDF reaches q, else T, at least `min_depth`."""
    reached = pdf.cumsum(1) >= q - 1e-7
    reached[:, -1] = True
    return reached.float().argmax(1).clamp(min=min_depth - 1) + 1


def lookahead_loss(head, hs, z):
    t = z.shape[0]
    logits = torch.stack([head(hs[r]).squeeze(-1) for r in range(t - 2)])  # [T-2, N]
    bce = F.binary_cross_entropy_with_logits(logits, torch.sigmoid(z[1 : t - 1]))
    student = lookahead_pdf(logits, t)
    return bce + cdf_l1(student, fold_to_min_two(teacher_pdf(z))), student, logits


def preloop_loss(head, emb, z):
    teacher = teacher_pdf(z)
    logp = F.log_softmax(head(emb), -1)
    kl = (teacher * (teacher.clamp_min(1e-12).log() - logp)).sum(1).mean()
    return kl + cdf_l1(logp.exp(), teacher), logp.exp()


def read_documents(path, tokenizer, window):
    """[(ids, in_loss)] per document. Plain text: `window`-token documents, every position in
    the loss. JSONL chat records: a position is in the loss when the next token is assistant text."""
    path = pathlib.Path(path)
    docs = []
    if path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            enc = tokenizer.encode(rec["text"])
            spans = rec.get("assistant", [])
            assistant = [any(a <= s < b for a, b in spans) for s, _ in enc.offsets]
            docs.append((enc.ids[:window], (assistant[1:] + [False])[:window]))
        return docs, "chat records: positions whose next token is assistant text"
    ids = tokenizer.encode(path.read_text()).ids
    for i in range(0, len(ids) - window + 1, window):
        doc = ids[i : i + window]
        docs.append((doc, [True] * (len(doc) - 1) + [False]))
    return docs, "plain text: every position whose next token is in the document (deviation: the authors train on assistant text only)"


def pack(docs, seq):
    """Best-fit-decreasing into sequences of at most `seq` tokens: [(ids, positions, doc, keep)]."""
    bins = []
    for ids, keep in sorted(docs, key=lambda d: -len(d[0])):
        ids, keep = ids[:seq], keep[:seq]
        fit = [b for b in bins if b["free"] >= len(ids)]
        b = min(fit, key=lambda b: b["free"]) if fit else None
        if b is None:
            b = {"free": seq, "docs": []}
            bins.append(b)
        b["docs"].append((ids, keep))
        b["free"] -= len(ids)
    out = []
    for b in bins:
        ids, pos, doc, keep = [], [], [], []
        for j, (d, k) in enumerate(b["docs"]):
            ids += d
            pos += range(len(d))
            doc += [j] * len(d)
            keep += k
        pad = seq - len(ids)
        out.append((ids + [0] * pad, pos + [0] * pad, doc + [-1 - j for j in range(pad)], keep + [False] * pad))
    return out


def to_batch(seqs, device):
    cols = list(zip(*seqs))
    return [torch.tensor(c, device=device) for c in cols[:3]] + [torch.tensor(cols[3], dtype=torch.bool, device=device)]


def lr_factor(step, warmup, total, floor=0.05):
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validate(model, la, pl, val, device, batch, doc_len):
    t = model.steps
    sums, n = {}, 0

    def add(k, v, w):
        sums[k] = sums.get(k, 0.0) + float(v) * w

    for i in range(0, len(val), batch):
        ids, pos, doc, keep = to_batch(val[i : i + batch], device)
        hs, z, emb = model.forward(ids, pos, doc, keep, doc_len)
        m = z.shape[1]
        _, student, logits = lookahead_loss(la, hs, z)
        _, pre = preloop_loss(pl, emb, z)
        teacher = teacher_pdf(z)
        add("hazard_mae", (torch.sigmoid(logits) - torch.sigmoid(z[1 : t - 1])).abs().mean(), m)
        add("preloop_pdf_mae", (pre - teacher).abs().mean(), m)
        add("preloop_cdf_mae", cdf_l1(pre, teacher), m)
        add("preloop_kl", (teacher * (teacher.clamp_min(1e-12).log() - pre.clamp_min(1e-12).log())).sum(1).mean(), m)
        for q in AGREEMENT_QS:
            stock = exit_depth(teacher, q, 2)
            for name, pdf in (("lookahead", student), ("preloop", pre)):
                d = exit_depth(pdf, q, 2)
                add(f"{name}_agreement@{q}", (d == stock).float().mean(), m)
                add(f"{name}_mean_depth@{q}", d.float().mean(), m)
            add(f"stock_mean_depth@{q}", stock.float().mean(), m)
        n += m
    return {k: round(v / max(n, 1), 5) for k, v in sums.items()} | {"positions": n}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Ouro checkpoint directory (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--corpus", required=True, help="plain text, or .jsonl chat records with assistant spans")
    ap.add_argument("--heldout", help="validation text in the same format (default: the corpus's last documents)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--tokens", type=int, help="train on this many tokens instead (steps = tokens / (batch * seq))")
    ap.add_argument("--seq", type=int, default=4096, help="packed sequence length")
    ap.add_argument("--batch", type=int, default=1, help="packed sequences per step")
    ap.add_argument("--window", type=int, default=4096, help="plain text: tokens per document")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=79)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--val-seqs", type=int, default=128, help="packed validation sequences")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the frozen model's dtype (the heads train in f32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-minutes", type=float, help="stop training after this long (the heads so far are written; the JSON says so)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device(args.device)
    model_dir = pathlib.Path(args.model)
    model = FrozenOuro(model_dir, getattr(torch, args.dtype), device)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    t, h = model.steps, model.hidden
    if t < 3:
        raise SystemExit(f"total_ut_steps {t}: a lookahead head needs at least 3 loop steps")

    docs, loss_positions = read_documents(args.corpus, tok, args.window)
    plain = not str(args.corpus).endswith(".jsonl") and not str(args.heldout or "").endswith(".jsonl")
    doc_len = args.window if plain and args.seq % args.window == 0 else None
    if args.heldout:
        val_docs, _ = read_documents(args.heldout, tok, args.window)
    else:
        cut = max(1, len(docs) // 20)
        docs, val_docs = docs[:-cut], docs[-cut:]
    train = pack(docs, args.seq)
    val = pack(val_docs, args.seq)
    rng = random.Random(args.seed)
    rng.shuffle(val)
    val = val[: args.val_seqs]
    if not train or not val:
        raise SystemExit("not enough text for one training and one validation sequence")
    steps = args.tokens // (args.batch * args.seq) if args.tokens else args.steps

    la = nn.Linear(h, 1).to(device)
    with torch.no_grad():  # initialised from the frozen stock gate
        la.weight.copy_(model.w["model.early_exit_gate.weight"].float())
        la.bias.copy_(model.w["model.early_exit_gate.bias"].float())
    pl = nn.Linear(h, t).to(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=args.weight_decay) for m in (la, pl)]
    # The cosine runs over the steps that will actually be taken: with --max-minutes, re-estimated
    # from the measured step rate after the first 50 steps, so a time-limited run still anneals.
    horizon = [steps]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, args.warmup, horizon[0])) for o in opts]

    evals, curve = [], []
    start = time.time()

    def evaluate(step):
        e = {"step": step, "seconds": round(time.time() - start, 1)} | validate(model, la, pl, val, device, max(1, args.batch), doc_len)
        evals.append(e)
        print(
            f"step {step:>6} val: lookahead agreement@0.2 {e['lookahead_agreement@0.2']:.3f} "
            f"(depth {e['lookahead_mean_depth@0.2']:.2f} vs stock {e['stock_mean_depth@0.2']:.2f}), "
            f"preloop agreement@0.2 {e['preloop_agreement@0.2']:.3f}, hazard MAE {e['hazard_mae']:.4f}",
            flush=True,
        )

    evaluate(0)
    train_start = time.time()
    order = []
    stopped_at = None
    for step in range(steps):
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            stopped_at = step
            evaluate(step)
            print(f"stopped after {step} of {steps} steps (--max-minutes {args.max_minutes})", flush=True)
            break
        if len(order) < args.batch:
            order += rng.sample(range(len(train)), len(train))
        pick, order = order[: args.batch], order[args.batch :]
        ids, pos, doc, keep = to_batch([train[i] for i in pick], device)
        hs, z, emb = model.forward(ids, pos, doc, keep, doc_len)
        if z.shape[1] == 0:
            continue
        la_loss, _, _ = lookahead_loss(la, hs, z)
        pl_loss, _ = preloop_loss(pl, emb, z)
        for opt, sched, head, loss in ((opts[0], scheds[0], la, la_loss), (opts[1], scheds[1], pl, pl_loss)):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
            opt.step()
            sched.step()
        if args.max_minutes and step == 50:
            rate = 50 / max(time.time() - train_start, 1e-9)
            horizon[0] = max(args.warmup + 1, min(steps, int(rate * (60 * args.max_minutes - (train_start - start)) * 0.95)))
            print(f"--max-minutes {args.max_minutes}: the schedule runs over {horizon[0]} steps", flush=True)
        if step % 100 == 0:
            curve.append({"step": step, "lookahead_loss": round(la_loss.item(), 5), "preloop_loss": round(pl_loss.item(), 5)})
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            evaluate(step + 1)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": la.weight.detach().float().cpu().contiguous(), "bias": la.bias.detach().float().cpu().contiguous()}, str(out / "lookahead_exit_gate.safetensors"))
    save_file({"weight": pl.weight.detach().float().cpu().contiguous(), "bias": pl.bias.detach().float().cpu().contiguous()}, str(out / "preloop_exit_gate.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights = [model_dir / f for f in shards]
    meta = {
        "recipe": "CDB authors' lookahead / preloop gates (shared/spec/lookahead-gate.md); teacher = the frozen stock gate",
        "settings": vars(args) | {"steps": steps, "steps_run": stopped_at if stopped_at is not None else steps, "schedule_steps": horizon[0]},
        "checkpoint": {"dir": str(model_dir), "files": {p.name: sha256(p) for p in weights}, "total_ut_steps": t, "hidden_size": h},
        "data": {
            "corpus": args.corpus,
            "corpus_sha256": sha256(args.corpus),
            "heldout": args.heldout,
            "heldout_sha256": sha256(args.heldout) if args.heldout else None,
            "loss_positions": loss_positions,
            "train_documents": len(docs),
            "train_sequences": len(train),
            "val_sequences": len(val),
            "tokens_seen": (stopped_at if stopped_at is not None else steps) * args.batch * args.seq,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "train_seconds": round(time.time() - start, 1),
        "validation": evals,
        "curve": curve,
    }
    (out / "gate_training_config.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}/lookahead_exit_gate.safetensors, preloop_exit_gate.safetensors, gate_training_config.json")


if __name__ == "__main__":
    main()
