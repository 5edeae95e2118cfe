#!/usr/bin/env python3
"""Writes the reference fixtures the Rust parity tests (tests/parity.rs) compare against, from
the independent float64 PyTorch references. Regenerate when assets change:

    python3 tools/reference/make_fixtures.py [--ouro DIR] [--sdar DIR] [--out-dir tests/fixtures]

- tiny_ouro_reference.json: next-token logits and per-step gate logits of the shipped tiny Ouro
  for fixed prompts (tools/reference/ouro_ref.py), and 8-token continuations at full depth — the
  greedy one and a fixed teacher-forced one — with every token's log-probability; and greedy
  decodes whose tokens exit by Q-exit (q 0.2 / 0.5 / 0.8, and 0.2 / 0.5 consumed one step late)
  over the shared and last-exited K/V layouts, with every token's loop steps (`gated`).
- tiny_sdar_reference.json (only if the SDAR directory exists; default assets/tiny-sdar): for
  fixed prompts, the canvas = prompt ids, then `mask_token_id` up to the end of the block holding
  the prompt's end (the first decode block), then one more full block of masks. Block-causal
  attention over the whole canvas (tools/reference/sdar_ref.py); recorded for every masked
  position of the FIRST decode block only: the top-5 ids and their logits, and the full logits
  row of the first two masked positions. Logits are f32-rounded to 9 significant digits. And
  greedy block-diffusion decodes of 24 tokens from each prompt under the threshold and static
  policies (`generate`, tools/reference/block_diffusion_ref.py).
"""
import argparse
import json
import pathlib

import torch
from tokenizers import Tokenizer

from diffusion_sampling import clear_sampled_decode
from fixture_checks import clearly_decided, wrong_rule_shows
from ouro_ref import OuroReference
from sources import sources
from sdar_ref import SDARReference, decode_canvas

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ["fn main() {", "Ownership is Rust's most unique feature", "The borrow checker"]
SDAR_PROMPTS = [
    "fn main() {",
    "Ownership is Rust's most unique feature and has deep implications for the rest of the language. "
    "It enables Rust to make memory safety guarantees without needing a garbage collector,",
    "The borrow checker",
]


# Greedy block-diffusion decodes of the tiny SDAR (tools/reference/block_diffusion_ref.py): two
# blocks and more of its 16, under the threshold policy (its default τ 0.9 and a looser one) and
# static counts.
SDAR_GEN = 24
SDAR_POLICIES = [("threshold", 0.9), ("threshold", 0.3), ("threshold", 0.1), ("static", 1), ("static", 3)]
# Sampled decodes (diffusion_sampling.py: SDAR's top-k, then top-p): (prompt index, policy,
# sampling). The trained model's long tail puts most draws at higher temperatures within
# MIN_MARGIN of another token; these seeds decide every draw clearly.
SDAR_SAMPLED = [
    (0, ("threshold", 0.9), {"temperature": 0.3, "seed": 1}),
    (0, ("threshold", 0.3), {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 6}),
    (1, ("threshold", 0.9), {"temperature": 0.3, "seed": 6}),
    (1, ("threshold", 0.3), {"temperature": 1.0, "top_k": 2, "top_p": 0.7, "seed": 3}),
]


def f32(x) -> float:
    return float(f"{float(torch.tensor(float(x), dtype=torch.float32)):.9g}")


def rel(path: pathlib.Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


CONTINUATION = 8
# Decodes whose tokens exit by Q-exit on the stock gate, over the shared and last-exited K/V
# layouts (ouro_ref.py `generate_gated`): (q, delay, min_steps) — the verdict on a step's own
# logit, or consumed one step late; a verdict counts from min_steps steps on (spec §1.4: "exit when
# exit_cdf >= q and step + 1 >= min_recurrent_steps", applied where the verdict is taken).
GATED = ((0.2, 0, 1), (0.5, 0, 1), (0.8, 0, 1), (0.2, 1, 1), (0.5, 1, 1), (0.2, 0, 2), (0.2, 1, 2))
GATED_GEN = 12


def continuation(ref: OuroReference, ids: list, forced: list = None) -> tuple:
    """Greedy tokens (or `forced` ones) after `ids`, each with its log-probability, the whole
    sequence recomputed at full depth for every token (EOS not special)."""
    ids, tokens, logprobs = list(ids), [], []
    for i in range(CONTINUATION):
        lp = ref.forward(ids)[0][-1].log_softmax(-1)
        t = int(lp.argmax()) if forced is None else forced[i]
        tokens.append(t)
        logprobs.append(float(lp[t]))
        ids.append(t)
    return tokens, logprobs


def ouro(model_dir: pathlib.Path, out_dir: pathlib.Path):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref = OuroReference(model_dir)
    vocab = ref.cfg["vocab_size"]
    cases = []
    for n, text in enumerate(PROMPTS):
        ids = tok.encode(text).ids
        logits, gates = ref.forward(ids)
        greedy, greedy_lp = continuation(ref, ids)
        # Tokens the model does not favour: their log-probabilities weigh the whole logit row.
        forced = [(n * 977 + i * 389 + 11) % vocab for i in range(CONTINUATION)]
        _, forced_lp = continuation(ref, ids, forced)
        cases.append({
            "text": text,
            "ids": ids,
            "logits_last": [float(f"{float(x):.9g}") for x in logits[-1]],
            "gate_logits_last": [float(f"{float(x):.9g}") for x in gates[:, -1]],
            "greedy": greedy,
            "greedy_logprobs": greedy_lp,
            "forced": forced,
            "forced_logprobs": forced_lp,
        })
    out = out_dir / "tiny_ouro_reference.json"
    gated = []
    for text in PROMPTS:
        ids = tok.encode(text).ids
        for q, delay, min_steps in GATED:
            for layout in ("shared", "last_exited"):
                margins = []
                tokens, depths, logprobs = ref.generate_gated(ids, GATED_GEN, q, min_steps, layout, margins, delay)
                if not clearly_decided(margins, f"{text!r} q {q} delay {delay} {layout}"):
                    continue
                gated.append({"ids": ids, "q": q, "delay": delay, "min_steps": min_steps, "layout": layout, "tokens": tokens, "depths": depths, "logprobs": logprobs, "min_margin": min(margins)})
    # A wrong last-exited copy rule must change some decode, or the fixture would not pin it.
    for wrong in ("previous", "none"):
        changed = sum(
            wrong_rule_shows(ref.generate_gated(g["ids"], GATED_GEN, g["q"], g["min_steps"], g["layout"], None, g["delay"], wrong), g)
            for g in gated
            if g["layout"] == "last_exited"
        )
        print(f"last-exited copy rule '{wrong}' changes {changed} decodes")
        assert changed > 0, f"no decode tells the '{wrong}' copy rule from the right one"
    made_from = sources("tools/reference/make_fixtures.py", "tools/reference/fixture_checks.py", "tools/reference/ouro_ref.py", *(rel(model_dir / f) for f in ("config.json", "model.safetensors", "tokenizer.json")))
    doc = {"model": rel(model_dir), "reference": "tools/reference/ouro_ref.py (float64)", "sources": made_from, "cases": cases, "gated": gated}
    out.write_text(json.dumps(doc))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def sdar(model_dir: pathlib.Path, out_dir: pathlib.Path):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref = SDARReference(model_dir)
    block, mask = ref.block, ref.mask_id
    cases = []
    for text in SDAR_PROMPTS:
        prompt = tok.encode(text).ids
        canvas, start, end = decode_canvas(prompt, block, mask)
        logits = ref.forward(canvas)
        positions = [i for i in range(start, end) if canvas[i] == mask]
        top = []
        for p in positions:
            vals, ids = logits[p].topk(5)
            top.append({"position": p, "ids": [int(i) for i in ids], "logits": [f32(v) for v in vals]})
        cases.append({
            "text": text,
            "prompt_ids": prompt,
            "ids": canvas,
            "decode_block": [start, end],
            "masked_positions": positions,
            "top5": top,
            "full_logits": [{"position": p, "logits": [f32(x) for x in logits[p]]} for p in positions[:2]],
        })
    generate = []
    for text in SDAR_PROMPTS:
        prompt = tok.encode(text).ids
        for kind, value in SDAR_POLICIES:
            margins = []
            tokens = ref.generate(prompt, SDAR_GEN, (kind, value), margins=margins)
            if not clearly_decided(margins, f"{text[:20]!r} {kind} {value}"):
                continue
            generate.append({"prompt_ids": prompt, "gen": SDAR_GEN, "policy": kind, "value": value, "tokens": tokens, "min_margin": min(margins)})
    for i, (kind, value), sampling in SDAR_SAMPLED:
        prompt = tok.encode(SDAR_PROMPTS[i]).ids
        decode = lambda draw, margins: ref.generate(prompt, SDAR_GEN, (kind, value), margins=margins, draw=draw)  # noqa: E731
        tokens, sampling, margin = clear_sampled_decode(decode, sampling, "p_then_k", tries=1)
        generate.append({"prompt_ids": prompt, "gen": SDAR_GEN, "policy": kind, "value": value, "tokens": tokens, "min_margin": margin, "sampling": sampling})
        print("sdar sampled", kind, value, sampling, tokens)
    out = out_dir / "tiny_sdar_reference.json"
    out.write_text(json.dumps({
        "model": rel(model_dir),
        "reference": "tools/reference/sdar_ref.py (float64, block-causal over the whole canvas)",
        "sources": sources(
            "tools/reference/make_fixtures.py",
            "tools/reference/fixture_checks.py",
            "tools/reference/sdar_ref.py",
            "tools/reference/block_diffusion_ref.py",
            "tools/reference/diffusion_sampling.py",
            *(rel(model_dir / f) for f in ("config.json", "model.safetensors", "tokenizer.json")),
        ),
        "block_size": block,
        "mask_token_id": mask,
        "vocab_size": ref.cfg["vocab_size"],
        "cases": cases,
        "generate": generate,
    }))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ouro", type=pathlib.Path, default=ROOT / "assets" / "tiny-ouro")
    ap.add_argument("--sdar", type=pathlib.Path, default=ROOT / "assets" / "tiny-sdar")
    ap.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "tests" / "fixtures")
    ap.add_argument("--only", choices=["ouro", "sdar"], help="write one model's fixture")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.only != "sdar":
        ouro(args.ouro, args.out_dir)
    if args.only == "ouro":
        return
    if (args.sdar / "config.json").exists():
        sdar(args.sdar, args.out_dir)
    else:
        print(f"{args.sdar}: no SDAR model, tiny_sdar_reference.json not written")


if __name__ == "__main__":
    main()
