#!/usr/bin/env python3
"""Fixtures for tests/parity_huginn.rs: greedy generations of a tiny random Huginn by the float64
reference (huginn_ref.py), with each token's log-probability, and the log-probabilities of a
fixed teacher-forced sequence; and greedy decodes whose tokens exit by the latent difference
over the shared and last-exited K/V layouts, with each token's recurrences (`gated`).

    cargo test --test parity_huginn -- --ignored write_reference_models   # writes target/reference-models/huginn{,-r2}
    python3 tools/reference/make_huginn_fixtures.py                         # writes tests/fixtures/tiny_huginn_reference.json

The Rust test rebuilds the same checkpoints from their seed (and checks the weight checksum
recorded here), generates every case through the engine in f32 on the CPU and compares: greedy
tokens, and the log-probabilities of those and of a teacher-forced sequence the model does not
favour.
"""
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fixture_checks import clearly_decided, wrong_rule_shows  # noqa: E402
from huginn_ref import Huginn, greedy, score  # noqa: E402
from sources import sources  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "target" / "reference-models"
GEN = 8
# Decodes whose tokens exit by the latent difference over the shared and last-exited layouts.
GATED_THRESHOLDS = (0.2, 0.3, 0.5, 0.7)
GATED_GEN = 10

# (model, prompt): prompts of 1 to 11 tokens; the second model is the same weights served at 2
# recurrences instead of 6.
CASES = [
    ("huginn", [5]),
    ("huginn", [5, 17, 3, 40, 22]),
    ("huginn", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90]),
    ("huginn", [30, 31, 32]),
    ("huginn-r2", [5, 17, 3, 40, 22]),
    ("huginn-r2", [9, 1, 33, 60, 2, 71, 8, 15, 44, 3, 90]),
]


def main():
    models = {name: Huginn(MODELS / name) for name in ("huginn", "huginn-r2")}
    steps = {name: json.loads((MODELS / name / "config.json").read_text())["max_steps"] for name in models}
    out = []
    for name, prompt in CASES:
        tokens, logprobs = greedy(models[name], prompt, GEN, steps[name])
        # Tokens the model does not favour: their log-probabilities weigh the whole logit row.
        forced = [(len(prompt) * 31 + i * 29 + 7) % 97 for i in range(GEN)]
        forced_logprobs = score(models[name], prompt, forced, steps[name])
        out.append(
            {
                "model": name,
                "prompt": prompt,
                "steps": steps[name],
                "tokens": tokens,
                "logprobs": logprobs,
                "forced": forced,
                "forced_logprobs": forced_logprobs,
            }
        )
        print(name, steps[name], prompt, tokens)
    gated = []
    for name, prompt in CASES:
        if name != "huginn":
            continue
        for threshold in GATED_THRESHOLDS:
            for layout in ("shared", "last_exited"):
                margins = []
                tokens, depths, logprobs = models[name].generate_gated(prompt, GATED_GEN, threshold, steps[name], layout, margins)
                if not clearly_decided(margins, f"{prompt} {threshold} {layout}"):
                    continue
                gated.append({"prompt": prompt, "threshold": threshold, "layout": layout, "tokens": tokens, "depths": depths, "logprobs": logprobs, "min_margin": min(margins)})
                print("gated", threshold, layout, prompt, depths)
    # A wrong last-exited copy rule must change some decode, or the fixture would not pin it.
    for wrong in ("previous", "none"):
        changed = sum(
            wrong_rule_shows(models["huginn"].generate_gated(g["prompt"], GATED_GEN, g["threshold"], steps["huginn"], g["layout"], copy=wrong), g)
            for g in gated
            if g["layout"] == "last_exited"
        )
        print(f"last-exited copy rule '{wrong}' changes {changed} decodes")
        assert changed > 0, f"no decode tells the '{wrong}' copy rule from the right one"
    doc = {
        "reference": "tools/reference/huginn_ref.py (float64 numpy, full depth, state 0, greedy)",
        "sources": sources("tools/reference/make_huginn_fixtures.py", "tools/reference/fixture_checks.py", "tools/reference/huginn_ref.py", "tools/reference/bidirectional_ref.py"),
        "models": "tests/parity_huginn.rs write_models: ponder::testing::write_random_huginn(tiny_huginn_config(97), seed 4) with non-zero q/k biases",
        "weight_abs_sum": float(sum(np.abs(v).sum() for v in models["huginn"].w.values())),
        # The configs the models were read with: the Rust test checks it writes the same.
        "configs": {name: json.loads((MODELS / name / "config.json").read_text()) for name in models},
        "cases": out,
        "gated": gated,
    }
    path = ROOT / "tests" / "fixtures" / "tiny_huginn_reference.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
