#!/usr/bin/env python3
"""Extracts the prose of the books shipped in the Rust toolchain's rust-docs component
(`$(rustc --print sysroot)/share/doc/rust/html`; all MIT OR Apache-2.0) into a training and a
held-out text file, split by page: within each book, the pages are sorted by path and page i
with i % 20 == 7 is held out. For "The Rust Programming Language" this is the split of the
original one-book corpus (the same five held-out chapters, pinned below and checked), so the
held-out text of earlier models stays held out.

Books: the Rust book (top-level chapter pages, >200 words, as before), the Reference, Rust By
Example (English only), the Rustonomicon, the Cargo book, the rustc book, the Edition Guide,
the rustdoc book, the Style Guide, the Clippy book, the Unstable Book and the error-code index
(other books: pages of >50 words). Left out: the API docs (std/, core/, ...), the mdBook
whole-book pages (print.html, toc.html; print.html would leak held-out chapters into training),
changelogs and index lists, and the Embedded Rust book (its prose is CC-BY-SA 4.0 by the book's
own notice). Pages are separated by `<|endoftext|>` (the tokenizer's special id 0), so models
learn where a document ends. Writes OUT/train.txt, OUT/heldout.txt and OUT/SOURCES.md.

    python3 tools/train/make_corpus.py [--html DIR] [--out corpus] [--books book,reference,...]
"""
import argparse
import hashlib
import html
import pathlib
import re
import subprocess

SEP = "<|endoftext|>"
LICENCE = "MIT OR Apache-2.0"
# dir, title, min words, top-level pages only, excluded paths (relative, or first directory)
BOOKS = [
    ("book", "The Rust Programming Language", 200, True, set()),
    ("reference", "The Rust Reference", 50, False, {"test-summary.html"}),
    ("rust-by-example", "Rust By Example", 50, False, {"zh", "ko", "ja", "es"}),
    ("nomicon", "The Rustonomicon", 50, False, set()),
    ("cargo", "The Cargo Book", 50, False, {"CHANGELOG.html"}),
    ("rustc", "The rustc book", 50, False, set()),
    ("edition-guide", "The Rust Edition Guide", 50, False, set()),
    ("rustdoc", "The rustdoc book", 50, False, set()),
    ("style-guide", "The Rust Style Guide", 50, False, set()),
    ("clippy", "The Clippy book", 50, False, set()),
    ("unstable-book", "The Unstable Book", 50, False, set()),
    ("error_codes", "Rust error codes index", 50, False, {"index.html", "error-index.html"}),
]
WHOLE_BOOK_PAGES = {"print.html", "toc.html", "404.html"}
# The held-out chapters of the original one-book corpus (i % 20 == 7 over its 99 chapters).
BOOK_HELDOUT = {
    "ch01-01-installation.html",
    "ch07-02-defining-modules-to-control-scope-and-privacy.html",
    "ch12-00-an-io-project.html",
    "ch15-05-interior-mutability.html",
    "ch19-03-pattern-syntax.html",
}


def html_dir() -> pathlib.Path:
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True).stdout.strip()
    return pathlib.Path(sysroot) / "share/doc/rust/html"


def chapter_text(page: str) -> str:
    start = page.find("<main>")
    if start < 0:
        return ""
    end = page.find("</main>", start)
    body = re.sub(r"<[^>]*>", "", page[start : end if end > 0 else len(page)])
    lines = [l.rstrip() for l in html.unescape(body).splitlines()]
    out, blank = [], 0
    for l in lines:
        if l.strip():
            out.append(l)
            blank = 0
        elif blank == 0:
            out.append("")
            blank = 1
    return "\n".join(out).strip() + "\n"


def book_pages(root: pathlib.Path, top_only: bool, exclude: set, min_words: int):
    files = sorted(root.glob("*.html") if top_only else root.rglob("*.html"))
    pages = []
    for p in files:
        rel = p.relative_to(root)
        if rel.name in WHOLE_BOOK_PAGES or str(rel) in exclude or rel.parts[0] in exclude:
            continue
        text = chapter_text(p.read_text(errors="replace")).replace(SEP, "")
        if len(text.split()) > min_words:
            pages.append((str(rel), text))
    return pages


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=pathlib.Path, default=None, help="share/doc/rust/html of a toolchain (default: rustc's sysroot)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("corpus"))
    ap.add_argument("--books", default=",".join(b[0] for b in BOOKS), help="comma-separated book directories")
    args = ap.parse_args()
    src = args.html or html_dir()
    wanted = args.books.split(",")
    args.out.mkdir(parents=True, exist_ok=True)

    train, held, rows, seen = [], [], [], set()
    for name, title, min_words, top_only, exclude in BOOKS:
        if name not in wanted:
            continue
        if not (src / name).is_dir():
            print(f"{name}: not in {src}, skipped")
            continue
        pages = book_pages(src / name, top_only, exclude, min_words)
        tr, he = [], []
        for i, (rel, text) in enumerate(pages):
            digest = hashlib.sha1(text.encode()).hexdigest()
            if digest in seen:  # identical pages (redirect copies) go to one side only
                continue
            seen.add(digest)
            (he if i % 20 == 7 or (name == "book" and rel in BOOK_HELDOUT) else tr).append((rel, text))
        if name == "book":
            held_names = {rel for rel, _ in he}
            missing = BOOK_HELDOUT - {rel for rel, _ in pages}
            assert not missing, f"Rust book chapters missing from this toolchain: {sorted(missing)}"
            assert BOOK_HELDOUT <= held_names, "the Rust book's original held-out chapters must stay held out"
        train += [t for _, t in tr]
        held += [t for _, t in he]
        rows.append((name, title, len(tr), sum(len(t) for _, t in tr), len(he), sum(len(t) for _, t in he), [r for r, _ in he]))
        print(f"{name}: {len(tr)} training pages ({rows[-1][3]} chars), {len(he)} held out ({rows[-1][5]} chars)")

    (args.out / "train.txt").write_text(SEP.join(train))
    (args.out / "heldout.txt").write_text(SEP.join(held))
    version = subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip() if args.html is None else str(src)
    lines = [
        "# Corpus sources",
        "",
        f"Extracted by `tools/train/make_corpus.py` from the rust-docs component ({version}): the `<main>`",
        "prose of each page, tags stripped; pages joined by `<|endoftext|>`. Held out: page i of each",
        "book (sorted by path) with i % 20 == 7, plus the five original Rust-book held-out chapters.",
        f"All books are {LICENCE} (the Rust project's COPYRIGHT; Rust By Example: Apache-2.0 OR MIT).",
        "The Embedded Rust book is left out: its prose is CC-BY-SA 4.0 by the book's own notice.",
        "",
        "| book | dir | licence | train pages | train chars | held-out pages | held-out chars |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, title, ntr, ctr, nhe, che, _ in rows:
        lines.append(f"| {title} | `{name}` | {LICENCE} | {ntr} | {ctr} | {nhe} | {che} |")
    tot = lambda k: sum(r[k] for r in rows)
    lines.append(f"| **total** | | | {tot(2)} | {tot(3)} | {tot(4)} | {tot(5)} |")
    lines += ["", "Held-out pages:", ""] + [f"- `{name}/{rel}`" for name, *_, hr in rows for rel in hr]
    (args.out / "SOURCES.md").write_text("\n".join(lines) + "\n")
    print(f"{len(train)} training pages ({tot(3)} chars), {len(held)} held out ({tot(5)} chars) -> {args.out}")


if __name__ == "__main__":
    main()
