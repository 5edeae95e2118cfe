#!/usr/bin/env python3
"""Fixtures for tests/parity_llada2.rs from the float64 references on tiny random MoE
checkpoints in the released layouts: LLaDA2.0 (llada2_ref.py) and SDAR's Qwen3-MoE layout
(sdar_ref.py).

    cargo test --test parity_llada2 -- --ignored write_reference_models  # target/reference-models/{llada2,sdar_moe}
    python3 tools/reference/make_llada2_fixtures.py    # tests/fixtures/tiny_{llada2,sdar_moe}_reference.json

Forward cases: a canvas (prompt + masks, blocks of 4 from position 0) → every position's
logits, and per MoE layer its MLP input and the experts the router chose there. Generate cases:
greedy block diffusion without a cache (block_diffusion_ref.py: LLaDA2.0 under thresholds with the
top-1 fallback, the SDAR MoE under thresholds and static counts) → tokens.
"""
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from llada2_ref import Llada2Reference  # noqa: E402
from sdar_ref import SDARReference  # noqa: E402
from diffusion_sampling import clear_sampled_decode  # noqa: E402
from fixture_checks import clearly_decided  # noqa: E402
from sources import sources  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [
    f"tools/reference/{f}"
    for f in ("make_llada2_fixtures.py", "fixture_checks.py", "llada2_ref.py", "sdar_ref.py", "block_diffusion_ref.py", "diffusion_sampling.py", "ouro_ref.py")
]
MODEL = ROOT / "target" / "reference-models" / "llada2"

FORWARD = [[5, 17, 3, 40, 22, 96, 96, 96], [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 96, 96], [30, 31, 32]]
GENERATE = [
    ([5, 17, 3, 40, 22], 11, 4, 0.9),
    ([9, 1, 33, 60, 2, 71, 8, 15], 8, 4, 0.3),
    ([30, 31, 32], 16, 8, 0.5),
    ([12, 50, 7, 7, 81, 4], 9, 4, 1.0),
    ([9, 1, 33, 60, 2, 71, 8, 15], 12, 4, 0.95),  # the released threshold: the engine's default for LLaDA2.0
]
# The tiny SDAR MoE decodes GENERATE's prompts and lengths in its own blocks of 4 under these.
SDAR_MOE_POLICIES = [("threshold", 0.2), ("threshold", 0.1), ("static", 1), ("static", 2)]
# Sampled decodes (diffusion_sampling.py: top-k, then top-p): (GENERATE index, sampling) for LLaDA2.0,
# (GENERATE index, policy, sampling) for the SDAR MoE.
LLADA2_SAMPLED = [(0, {"temperature": 0.8, "seed": 1}), (2, {"temperature": 0.2, "top_k": 3, "top_p": 0.8, "seed": 1}), (4, {"temperature": 0.5, "top_p": 0.9, "seed": 3})]
SDAR_MOE_SAMPLED = [(0, ("threshold", 0.2), {"temperature": 0.7, "seed": 4}), (1, ("static", 2), {"temperature": 0.2, "top_k": 3, "top_p": 0.8, "seed": 0})]
# (case index, eos): the same decode with an EOS id that the EOS-free decode produces mid-way.
EOS_CASE = (3, 9)


def variant_routes(ref, b, bias, groups):
    """The experts the router would choose without the selection bias and / or the group limit."""
    c = ref.c
    scores = torch.sigmoid(b @ ref.w[f"{ref._p}.mlp.gate.weight"].T)
    choice = scores + (ref.w[f"{ref._p}.mlp.gate.expert_bias"] if bias else 0)
    g, kg, e = c.get("n_group", 1), c.get("topk_group", 1), c["num_experts"]
    if groups and g > 1:
        per = e // g
        group = choice.view(-1, g, per).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group, dtype=torch.bool)
        keep.scatter_(1, group.topk(kg, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    return choice.topk(c["num_experts_per_tok"], dim=-1).indices


def main():
    ref = Llada2Reference(MODEL)
    weights = sum(float(v.abs().sum()) for v in ref.w.values())
    forward = []
    for ids in FORWARD:
        captured = []
        orig = ref.route

        def spy(b, orig=orig, captured=captured):
            chosen, w = orig(b)
            changed = [int((variant_routes(ref, b, bias, groups) != chosen).any(-1).sum()) for bias, groups in ((False, True), (True, False))]
            captured.append((b.tolist(), chosen.tolist(), changed))
            return chosen, w

        ref.route = spy
        logits, _ = ref.forward(ids, 4)
        ref.route = orig
        forward.append(
            {
                "ids": ids,
                "logits": logits.tolist(),
                "moe_inputs": [c[0] for c in captured],
                "experts": [c[1] for c in captured],
                # Tokens whose experts change without the bias / without the group limit, per layer.
                "changed_without_bias": [c[2][0] for c in captured],
                "changed_without_groups": [c[2][1] for c in captured],
            }
        )
    generate = []
    for i, (p, g, b, t) in enumerate(GENERATE):
        margins = []
        tokens = ref.generate(p, g, b, t, margins=margins)
        if i == EOS_CASE[0]:
            eos = EOS_CASE[1]
            assert eos in tokens[:-1], "the EOS must cut the EOS-free decode"
            eos_case = {"prompt": p, "gen": g, "block": b, "threshold": t, "eos": [eos], "tokens": ref.generate(p, g, b, t, eos=(eos,))}
        if not clearly_decided(margins, f"llada2 {p} {t}"):
            continue
        generate.append({"prompt": p, "gen": g, "block": b, "threshold": t, "eos": [], "tokens": tokens, "min_margin": min(margins)})
    generate.append(eos_case)
    for i, sampling in LLADA2_SAMPLED:
        p, g, b, t = GENERATE[i]
        decode = lambda draw, margins: ref.generate(p, g, b, t, margins=margins, draw=draw)  # noqa: E731
        tokens, sampling, margin = clear_sampled_decode(decode, sampling, "p_then_k")
        generate.append({"prompt": p, "gen": g, "block": b, "threshold": t, "eos": [], "tokens": tokens, "min_margin": margin, "sampling": sampling})
    doc = {"source": "tools/reference/llada2_ref.py (float64)", "sources": sources(*SOURCES), "config": json.loads((MODEL / "config.json").read_text()), "weight_abs_sum": weights, "forward": forward, "generate": generate}
    out = ROOT / "tests" / "fixtures" / "tiny_llada2_reference.json"
    out.write_text(json.dumps(doc) + "\n")
    for g in generate:
        print(g["prompt"], g["threshold"], "->", g["tokens"])
    print(f"wrote {out}")
    sdar_moe()


def sdar_moe():
    ref = SDARReference(ROOT / "target" / "reference-models" / "sdar_moe", block_size=4)
    weights = sum(float(v.abs().sum()) for v in ref.w.values())
    forward = []
    for ids in FORWARD:
        logits = ref.forward(ids)
        forward.append({"ids": ids, "logits": logits.tolist(), "moe_inputs": [r[0] for r in ref.routes], "experts": [r[1] for r in ref.routes]})
    generate = []
    for p, g, _, _ in GENERATE:
        for kind, value in SDAR_MOE_POLICIES:
            margins = []
            tokens = ref.generate(p, g, (kind, value), margins=margins)
            if not clearly_decided(margins, f"sdar_moe {p} {kind} {value}"):
                continue
            generate.append({"prompt": p, "gen": g, "policy": kind, "value": value, "tokens": tokens, "min_margin": min(margins)})
    one_a_step = {tuple(g["prompt"]): g["tokens"] for g in generate if (g["policy"], g["value"]) == ("static", 1)}
    for i, (kind, value), sampling in SDAR_MOE_SAMPLED:
        p, g, _, _ = GENERATE[i]
        decode = lambda draw, margins: ref.generate(p, g, (kind, value), margins=margins, draw=draw)  # noqa: E731
        tokens, sampling, margin = clear_sampled_decode(decode, sampling, "p_then_k")
        generate.append({"prompt": p, "gen": g, "policy": kind, "value": value, "tokens": tokens, "min_margin": margin, "sampling": sampling})
    assert any(g["policy"] == "threshold" and g["tokens"] != one_a_step.get(tuple(g["prompt"]), g["tokens"]) for g in generate), (
        "no threshold decode reveals more than one token a step somewhere"
    )
    out = ROOT / "tests" / "fixtures" / "tiny_sdar_moe_reference.json"
    config = json.loads((ROOT / "target" / "reference-models" / "sdar_moe" / "config.json").read_text())
    doc = {"source": "tools/reference/sdar_ref.py (float64)", "sources": sources(*SOURCES), "config": config, "weight_abs_sum": weights, "forward": forward, "generate": generate}
    out.write_text(json.dumps(doc) + "\n")
    for g in generate:
        print("sdar_moe", g["prompt"], g["policy"], g["value"], "->", g["tokens"])
    print(f"wrote {out}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
