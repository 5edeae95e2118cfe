#!/usr/bin/env python3
"""Held-out perplexity of a looped Ouro model per loop count, computed with the independent
PyTorch forward of ouro_ref.py (float32, CPU), two ways:

  (a) on the windows examples/quality.rs scores (corpus/heldout.txt tokenized whole, cut into
      non-overlapping windows of 32 + 96 tokens, `--sequences` of them evenly spaced, the last
      96 tokens of each scored), so its fixed-depth rows can be checked against a second
      implementation;
  (b) with tools/train/train_ouro.py's final-evaluation protocol (every window of 256 tokens,
      each token predicted from the earlier tokens of its window), the numbers in training.json.

    python3 tools/reference/ouro_heldout_ppl.py [--model assets/tiny-ouro]
        [--heldout corpus/heldout.txt] [--sequences 32] [--skip-trainer]
"""
import argparse
import math
import pathlib
import sys

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ouro_ref import OuroReference  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/tiny-ouro")
    ap.add_argument("--heldout", default="corpus/heldout.txt")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--skip-trainer", action="store_true", help="only (a)")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(pathlib.Path(args.model) / "tokenizer.json"))
    ids = tok.encode(pathlib.Path(args.heldout).read_text()).ids
    ref = OuroReference(args.model, dtype=torch.float32)
    loops = ref.steps

    def nll(seq, first_scored, depth):
        """Summed NLL of seq[first_scored:] given the earlier tokens, and the count."""
        ref.steps = depth
        logits, _ = ref.forward(seq)
        lp = torch.log_softmax(logits[:-1].double(), -1)
        tgt = torch.tensor(seq[1:])
        picked = lp[torch.arange(len(tgt)), tgt][first_scored - 1 :]
        return -picked.sum().item(), picked.numel()

    prompt, scored = 32, 96
    w = prompt + scored
    total = len(ids) // w
    n = min(args.sequences, total)
    picked = [i * total // n for i in range(n)]
    print(f"{len(ids)} held-out tokens")
    for d in range(1, loops + 1):
        s = c = 0
        for i in picked:
            a, b = nll(ids[i * w : (i + 1) * w], prompt, d)
            s, c = s + a, c + b
        print(f"(a) examples/quality.rs windows ({n} x {scored} tokens), {d} loop(s): perplexity {math.exp(s / c):.2f}")
    if args.skip_trainer:
        return
    xs = ids[: (len(ids) - 1) // 256 * 256 + 1]
    for d in range(1, loops + 1):
        s = c = 0
        for i in range(0, len(xs) - 1, 256):
            a, b = nll(xs[i : i + 257], 1, d)
            s, c = s + a, c + b
        print(f"(b) trainer protocol ({c} tokens), {d} loop(s): perplexity {math.exp(s / c):.2f}")


if __name__ == "__main__":
    main()
