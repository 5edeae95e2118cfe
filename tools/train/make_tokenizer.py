#!/usr/bin/env python3
"""Trains the byte-level BPE tokenizer (GPT-2 style) for the tiny models on the TRAINING split
only (corpus/train.txt from tools/train/make_corpus.py): ByteLevel pre-tokenizer without a prefix
space, ByteLevel decoder, vocabulary 4096 including the 256 byte symbols, merges of pairs seen at
least twice. Special tokens: `<|endoftext|>` (id 0; end of document, eos) and `<|mask|>` (id 1;
the mask token of the diffusion LM). The corpus separates pages with `<|endoftext|>`; the
tokenizer is trained on the pages themselves, so the separator's text never feeds the merges.

    python3 tools/train/make_tokenizer.py [--corpus corpus] [--out corpus/tokenizer.json]
"""
import argparse
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|mask|>"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=pathlib.Path, default=pathlib.Path("corpus"))
    ap.add_argument("--out", type=pathlib.Path, default=None, help="default: CORPUS/tokenizer.json")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--min-frequency", type=int, default=2)
    args = ap.parse_args()
    out = args.out or args.corpus / "tokenizer.json"

    pages = [p for p in (args.corpus / "train.txt").read_text().split(SPECIALS[0]) if p.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=args.min_frequency,
        special_tokens=SPECIALS,  # ids 0 and 1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pages, trainer=trainer, length=len(pages))
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))

    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids == {"<|endoftext|>": 0, "<|mask|>": 1}, ids
    sample = "fn main() {\n    println!(\"Hello, world!\");\n}<|endoftext|>"
    enc = tok.encode(sample)
    assert tok.decode(enc.ids, skip_special_tokens=False) == sample, tok.decode(enc.ids, skip_special_tokens=False)
    print(f"vocab size {tok.get_vocab_size()}; <|endoftext|> = {ids['<|endoftext|>']}, <|mask|> = {ids['<|mask|>']}; "
          f"{len(pages)} training pages -> {out}")
    print(f"sample {sample!r} -> {len(enc.ids)} tokens {enc.tokens}")


if __name__ == "__main__":
    main()
