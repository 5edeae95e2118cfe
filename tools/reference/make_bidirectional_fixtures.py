#!/usr/bin/env python3
"""Fixtures for tests/parity_bidirectional.rs: greedy and sampled decodes of tiny random LLaDA and
Dream checkpoints by the float64 reference (bidirectional_ref.py, diffusion_sampling.py).

    cargo test --test parity_bidirectional -- --ignored write_reference_models   # writes target/reference-models/{llada,dream}
    python3 tools/reference/make_bidirectional_fixtures.py                         # writes tests/fixtures/tiny_bidirectional_reference.json

The Rust test rebuilds the same checkpoints from their seeds (and checks the weight checksum
recorded here), decodes every case through the engine in f32 on the CPU and compares tokens.
"""
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bidirectional_ref import Model, dream_sampler, semi_ar  # noqa: E402
from diffusion_sampling import clear_sampled_decode  # noqa: E402
from fixture_checks import MIN_MARGIN  # noqa: E402
from sources import sources  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "target" / "reference-models"

# (family, prompt, gen, block, steps, schedule): prompts whose length is not a multiple of the
# block, generations that leave a shorter last block, every schedule.
CASES = [
    ("llada", [5, 17, 3, 40, 22], 12, 4, 2, "linear"),
    ("llada", [30, 31, 32], 12, 4, 4, "linear"),
    ("llada", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 8, 4, "linear"),
    ("llada", [30, 31, 32], 16, 8, 8, "linear"),
    ("llada", [12, 50, 7, 7, 81], 12, 4, 4, "static:2"),
    ("llada", [30, 31, 32], 12, 8, 8, "threshold:0.3"),
    ("dream", [5, 17, 3, 40, 22], 12, 4, 2, "linear"),
    ("dream", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 8, 4, "linear"),
    ("dream", [12, 50, 7, 7, 81], 12, 8, 8, "threshold:0.3"),
    ("dream", [5, 17, 3, 40, 22], 12, 0, 12, "dream:maskgit_plus"),
    ("dream", [5, 17, 3, 40, 22], 12, 0, 6, "dream:topk_margin"),
    ("dream", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 0, 10, "dream:entropy"),
    ("dream", [44, 3, 90, 12], 16, 0, 32, "dream:maskgit_plus"),
]
# LLaDA under Fast-dLLM's prefix and dual caches: (prompt, gen, block, steps, schedule, cache).
CACHED = [
    ([5, 17, 3, 40, 22], 12, 4, 4, "linear", "prefix"),
    ([5, 17, 3, 40, 22], 12, 4, 4, "linear", "dual"),
    ([9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 8, 4, "linear", "prefix"),
    ([9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 8, 4, "linear", "dual"),
    ([30, 31, 32], 16, 8, 8, "threshold:0.3", "prefix"),
    ([30, 31, 32], 16, 8, 8, "threshold:0.3", "dual"),
    ([12, 50, 7, 7, 81], 12, 4, 4, "static:1", "dual"),
]

# Sampled decodes: (family, prompt, gen, block, steps, schedule, cache, sampling). The seed is the
# first from the one given whose decode decides nothing within MIN_MARGIN.
SAMPLED = [
    ("llada", [5, 17, 3, 40, 22], 12, 4, 2, "linear", None, {"temperature": 0.8, "seed": 1}),
    ("llada", [30, 31, 32], 12, 8, 8, "threshold:0.3", None, {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "seed": 2}),
    ("llada", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 8, 4, "linear", "dual", {"temperature": 0.7, "seed": 3}),
    ("dream", [5, 17, 3, 40, 22], 12, 4, 2, "linear", None, {"temperature": 0.5, "top_p": 0.95, "seed": 4}),
    ("dream", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90], 10, 0, 10, "dream:entropy", None, {"temperature": 0.2, "seed": 5}),
    ("dream", [5, 17, 3, 40, 22], 12, 0, 6, "dream:topk_margin", None, {"temperature": 1.0, "top_k": 4, "seed": 6}),
    ("dream", [12, 50, 7, 7, 81], 12, 8, 8, "threshold:0.3", None, {"temperature": 0.8, "top_k": 3, "top_p": 0.8, "seed": 8}),
]


# What a family's sampler is told apart from where a case gives both cuts: the other order (for
# LLaDA: confidence on the cut distribution instead of the untempered one).
WRONG = {"llada": "k_then_p", "dream": "k_then_p"}


def sampled_decode(model, family, prompt, gen, block, steps, schedule, cache, sampling):
    def decode(draw, margins):
        if schedule.startswith("dream:"):
            return dream_sampler(model, prompt, gen, steps, schedule.split(":")[1], margins=margins, draw=draw)
        return semi_ar(model, prompt, gen, block, steps, schedule, cache or "exact", margins, draw=draw)

    return clear_sampled_decode(decode, sampling, WRONG[family])


def main():
    models = {f: Model(MODELS / f) for f in ("llada", "dream")}
    out = []
    for family, prompt, gen, block, steps, schedule in CASES:
        m = models[family]
        margins = []
        if schedule.startswith("dream:"):
            tokens = dream_sampler(m, prompt, gen, steps, schedule.split(":")[1], margins=margins)
        else:
            tokens = semi_ar(m, prompt, gen, block, steps, schedule, margins=margins)
        assert min(margins) > MIN_MARGIN, f"{family} {schedule} {prompt}: a decision within {min(margins):.1e}; pick another prompt"
        out.append({"family": family, "prompt": prompt, "gen": gen, "block": block, "steps": steps, "schedule": schedule, "tokens": tokens, "min_margin": min(margins)})
        print(family, schedule, block, steps, tokens)
    for prompt, gen, block, steps, schedule, cache in CACHED:
        margins = []
        tokens = semi_ar(models["llada"], prompt, gen, block, steps, schedule, cache, margins)
        assert min(margins) > MIN_MARGIN, f"llada {schedule} {cache} {prompt}: a decision within {min(margins):.1e}"
        exact = semi_ar(models["llada"], prompt, gen, block, steps, schedule)
        out.append({"family": "llada", "prompt": prompt, "gen": gen, "block": block, "steps": steps, "schedule": schedule, "cache": cache, "tokens": tokens, "min_margin": min(margins)})
        print("llada", schedule, cache, block, steps, tokens, "(differs from exact)" if tokens != exact else "")
    for family, prompt, gen, block, steps, schedule, cache, sampling in SAMPLED:
        tokens, sampling, margin = sampled_decode(models[family], family, prompt, gen, block, steps, schedule, cache, sampling)
        case = {"family": family, "prompt": prompt, "gen": gen, "block": block, "steps": steps, "schedule": schedule, "tokens": tokens, "min_margin": margin, "sampling": sampling}
        if cache:
            case["cache"] = cache
        out.append(case)
        print(family, schedule, cache or "", sampling, tokens)
    checksums = {f: float(sum(np.abs(v).sum() for v in m.w.values())) for f, m in models.items()}
    doc = {
        "reference": "tools/reference/bidirectional_ref.py (float64 numpy; greedy, and sampled by diffusion_sampling.py)",
        "sources": sources("tools/reference/make_bidirectional_fixtures.py", "tools/reference/fixture_checks.py", "tools/reference/bidirectional_ref.py", "tools/reference/diffusion_sampling.py"),
        "models": "ponder::testing::write_random_{llada,dream}(tiny_{llada,dream}_config(97), seed 11 / 52)",
        "weight_abs_sum": checksums,
        # The configs the models were read with: the Rust test checks it writes the same.
        "configs": {f: json.loads((MODELS / f / "config.json").read_text()) for f in models},
        "cases": out,
    }
    path = ROOT / "tests" / "fixtures" / "tiny_bidirectional_reference.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
