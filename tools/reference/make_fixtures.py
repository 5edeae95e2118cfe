#!/usr/bin/env python3
"""Writes tests/fixtures/tiny_ouro_reference.json: next-token logits and per-step gate logits of
the shipped tiny Ouro for fixed prompts, from the independent PyTorch reference (float64).
The Rust parity test (tests/parity.rs) compares against it. Regenerate when assets change:

    python3 tools/reference/make_fixtures.py
"""
import json
import pathlib

from tokenizers import Tokenizer

from ouro_ref import OuroReference

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ["fn main() {", "Ownership is Rust's most unique feature", "The borrow checker"]


def main():
    model_dir = ROOT / "assets" / "tiny-ouro"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref = OuroReference(model_dir)
    cases = []
    for text in PROMPTS:
        ids = tok.encode(text).ids
        logits, gates = ref.forward(ids)
        cases.append({
            "text": text,
            "ids": ids,
            "logits_last": [float(f"{float(x):.9g}") for x in logits[-1]],
            "gate_logits_last": [float(f"{float(x):.9g}") for x in gates[:, -1]],
        })
    out = ROOT / "tests" / "fixtures" / "tiny_ouro_reference.json"
    out.write_text(json.dumps({"model": "assets/tiny-ouro", "reference": "tools/reference/ouro_ref.py (float64)", "cases": cases}))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
