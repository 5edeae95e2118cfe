#!/usr/bin/env python3
"""Independent reference for chat-template rendering: renders the dialect templates of
tests/chat.rs with Python's jinja2, set up the way Hugging Face's `apply_chat_template` sets it
up (sandboxed, trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a `tojson` that is
`json.dumps(ensure_ascii=False)`), over a few conversations, and writes
tests/fixtures/chat_reference.json, which tests/chat.rs compares ponder's rendering with.

    python3 tools/reference/chat_reference.py
"""
import hashlib
import json
import pathlib
import re

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

root = pathlib.Path(__file__).resolve().parents[2]
source = (root / "tests" / "chat.rs").read_text()
templates = dict(re.findall(r'const (\w+): &str = r#"(.*?)"#;', source, re.S))


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception

conversations = {
    "three_turns": [
        {"role": "user", "content": "What does `&mut` mean?"},
        {"role": "assistant", "content": "A unique borrow."},
        {"role": "user", "content": "And `&`?"},
    ],
    "with_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Lifetimes, in one line?  "},
    ],
    "unicode": [{"role": "user", "content": "Ünïcödé — “quotes” and ✓"}],
}
cases = []
for name, template in sorted(templates.items()):
    if name == "SPECIAL":
        continue
    for conv_name, messages in conversations.items():
        for add_generation_prompt in (True, False):
            for kwargs in ({}, {"enable_thinking": False}):
                ctx = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<|startoftext|>", eos_token="<|endoftext|>", **kwargs)
                try:
                    text, error = env.from_string(template).render(**ctx), None
                except jinja2.exceptions.TemplateError as e:
                    text, error = None, str(e)
                cases.append({"template": name, "conversation": conv_name, "messages": messages, "add_generation_prompt": add_generation_prompt,
                              "kwargs": kwargs, "text": text, "error": error})
out = root / "tests" / "fixtures" / "chat_reference.json"
made_from = {"tools/reference/chat_reference.py": hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()}
out.write_text(json.dumps({"generator": "tools/reference/chat_reference.py", "sources": made_from, "jinja2": jinja2.__version__, "cases": cases}, ensure_ascii=False, indent=1) + "\n")
print(f"{len(cases)} cases from {len(templates) - ('SPECIAL' in templates)} templates -> {out.relative_to(root)}")
