#!/usr/bin/env python3
"""Extracts the prose of "The Rust Programming Language" (shipped with the Rust toolchain's
rust-docs component; MIT OR Apache-2.0) into a training and a held-out text file, split by
chapter (every 20th chapter is held out).

    python3 tools/train/make_corpus.py [BOOK_HTML_DIR] [OUT_DIR]
"""
import html
import pathlib
import re
import subprocess
import sys


def book_dir() -> pathlib.Path:
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True).stdout.strip()
    return pathlib.Path(sysroot) / "share/doc/rust/html/book"


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


def main():
    src = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else book_dir()
    dst = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else pathlib.Path("corpus")
    dst.mkdir(parents=True, exist_ok=True)
    chapters = [chapter_text(p.read_text(errors="replace")) for p in sorted(src.glob("*.html"))]
    chapters = [c for c in chapters if len(c.split()) > 200]
    train = [c for i, c in enumerate(chapters) if i % 20 != 7]
    held = [c for i, c in enumerate(chapters) if i % 20 == 7]
    (dst / "train.txt").write_text("\n\n".join(train))
    (dst / "heldout.txt").write_text("\n\n".join(held))
    words = lambda cs: sum(len(c.split()) for c in cs)
    print(f"{len(train)} training chapters ({words(train)} words), {len(held)} held out ({words(held)} words) -> {dst}")


if __name__ == "__main__":
    main()
