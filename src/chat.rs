//! Chat prompts, rendered with the checkpoint's own Jinja chat template the way Hugging Face's
//! `apply_chat_template` renders it: blocks trimmed (`trim_blocks`, `lstrip_blocks`), the
//! variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and any extra keyword
//! (`enable_thinking`, …), Python's string and dict methods (`strip`, `split`, `startswith`,
//! `items`, …), `raise_exception`, and a `tojson` that writes what Python's `json.dumps` writes.
//! Rendering is bounded (fuel, recursion limit, a time limit, a rendering thread whose stack
//! covers the deepest value the fuel can build, a bound on `tojson`'s output, no `Debug`
//! pretty-printers), so a template from a file cannot hang the caller or take the process down:
//! it fails with [`Error::ChatTemplate`].

use crate::{Error, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or whatever roles the template knows).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A conversation to continue: the messages so far, whether the template should open the
/// assistant's turn (default yes), and extra template variables such as `enable_thinking`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Chat {
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self { messages, add_generation_prompt: true, kwargs: serde_json::Map::new() }
    }
    /// Sets an extra template variable (`Chat::new(m).with("enable_thinking", false)`).
    pub fn with(mut self, key: impl Into<String>, value: impl Into<serde_json::Value>) -> Self {
        self.kwargs.insert(key.into(), value.into());
        self
    }
}

/// Most template instructions one rendering may run (minijinja also charges one per 64 bytes it
/// builds): generous for any real conversation (a Qwen3-style template with tools spends ≈ 86 a
/// message and 0.02–0.18 a byte of content: 5–15 MB of text), a bound for a template that
/// loops without end, and the bound on how deep a value a template can build (below).
const FUEL: u64 = 1_000_000;
/// Stack of the thread a template renders on. A template can nest a value one level per ≈ 1.5
/// instructions (`{% set ns.x = [[…[ns.x]…]] %}` in a loop: ≤ 0.7 M levels on the fuel), and
/// minijinja recurses once a level to print such a value (368 bytes a level measured with
/// minijinja optimised, ≈ 1.5 KB unoptimised) and to drop it (64): on an 8 MB stack that
/// overflowed — a process abort — from ≈ 22 000 levels. 2 GiB covers printing the deepest value
/// the fuel allows in either build. Reserved address space: only such a template touches it.
const RENDER_STACK_BYTES: usize = 2 << 30;
/// Longest template source accepted (real chat templates are a few KB).
const TEMPLATE_MAX_BYTES: usize = 1 << 20;
/// Longest a rendering may take. Fuel does not bound everything a template can do with deep
/// values (comparing two 250 000-level lists is one instruction and takes ≈ 0.1 s), so a
/// rendering past this is abandoned with an error and the template refuses to render again. The
/// abandoned thread cannot be stopped: it runs on, possibly for long, on one core.
const RENDER_TIME_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A compiled chat template with the special tokens it is rendered with. Clones share the
/// compiled template and its runaway flag: one that ran past its time limit stays refused in
/// every clone.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    time_limit: std::time::Duration,
    /// Set when a rendering ran past the time limit: the template is not rendered again (each
    /// try would leave another thread running).
    runaway: Arc<AtomicBool>,
}

impl ChatTemplate {
    /// Compiles `source`; a template that does not parse is [`Error::ChatTemplate`]. Compiles on
    /// a thread of its own too: the parser recurses once a link of a chain such as `1 + 1 + …`,
    /// which overflowed the caller's stack from ≈ 5 000 links.
    pub fn new(source: impl Into<String>, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let source = source.into();
        if source.len() > TEMPLATE_MAX_BYTES {
            return Err(Error::ChatTemplate(format!("the template is {} bytes, above {} MiB", source.len(), TEMPLATE_MAX_BYTES >> 20)));
        }
        let env = spawn_big_stack(move || compile(source))?.join().unwrap_or_else(|_| Err(Error::ChatTemplate("compiling the template panicked".into())))?;
        Ok(Self {
            env: Arc::new(env),
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            time_limit: RENDER_TIME_LIMIT,
            runaway: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The prompt text for `chat`; a template that fails (an exception it raises, an undefined
    /// method, running out of fuel or time) is [`Error::ChatTemplate`]. Renders on a thread of
    /// its own whose stack covers the deepest value the template can build.
    pub fn render(&self, chat: &Chat) -> Result<String> {
        if self.runaway.load(Ordering::Relaxed) {
            return Err(Error::ChatTemplate(format!("the template is disabled: a rendering ran past {:?}", self.time_limit)));
        }
        let mut ctx = chat.kwargs.clone();
        let messages = serde_json::to_value(&chat.messages).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        ctx.insert("messages".into(), messages);
        ctx.insert("add_generation_prompt".into(), chat.add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        let env = Arc::clone(&self.env);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        spawn_big_stack(move || {
            let rendered =
                env.get_template("chat").and_then(|t| t.render(Value::from(minijinja::value::Serde(&ctx)))).map_err(|e| Error::ChatTemplate(describe(&e)));
            let _ = tx.send(rendered);
        })?;
        match rx.recv_timeout(self.time_limit) {
            Ok(rendered) => rendered,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.runaway.store(true, Ordering::Relaxed);
                Err(Error::ChatTemplate(format!("rendering ran past {:?}; the template is disabled", self.time_limit)))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::ChatTemplate("rendering the template panicked".into())),
        }
    }
}

/// Runs `f` on a thread whose stack covers the deepest recursion a template can cause (compiling
/// or rendering; see `RENDER_STACK_BYTES`).
fn spawn_big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<std::thread::JoinHandle<T>> {
    std::thread::Builder::new()
        .name("ponder-chat-template".into())
        .stack_size(RENDER_STACK_BYTES)
        .spawn(f)
        .map_err(|e| Error::ChatTemplate(format!("cannot start the template's thread ({} MiB of stack): {e}", RENDER_STACK_BYTES >> 20)))
}

/// The template's environment: Hugging Face's syntax and globals, our bounds.
fn compile(source: String) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|e| Error::ChatTemplate(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(python_methods);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    // Both pretty-print a value through `Debug`, superlinear in its nesting and not counted by
    // the fuel (8 000 levels ran past a minute); chat templates do not use them.
    env.remove_filter("pprint");
    env.remove_global("debug");
    env.add_template_owned("chat", source).map_err(|e| Error::ChatTemplate(describe(&e)))?;
    Ok(env)
}

/// Widest field a `str.format` call may ask for (`"{:>N}"`, `"{:.N}"`).
const FORMAT_MAX_WIDTH: u64 = 10_000;

/// Python's string, dict and list methods (minijinja-contrib's pycompat), except that
/// `str.format` refuses fields wider than `FORMAT_MAX_WIDTH`: pycompat formats without charging
/// fuel first, and `"{:>999999999999}".format(1)` aborted the process on the allocation.
fn python_methods(state: &mut minijinja::State, value: &Value, method: &str, args: &[Value]) -> std::result::Result<Value, minijinja::Error> {
    if method == "format" {
        if let Some(spec) = value.as_str() {
            check_format_widths(spec)?;
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Refuses a format string with a number above `FORMAT_MAX_WIDTH` inside a `{…}` field.
fn check_format_widths(spec: &str) -> std::result::Result<(), minijinja::Error> {
    let mut depth = 0usize;
    let mut number: u64 = 0;
    for c in spec.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        match c.to_digit(10) {
            Some(d) if depth > 0 => {
                number = number.saturating_mul(10).saturating_add(u64::from(d));
                if number > FORMAT_MAX_WIDTH {
                    return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("str.format: a field wider than {FORMAT_MAX_WIDTH}")));
                }
            }
            _ => number = 0,
        }
    }
    Ok(())
}

/// The error's message with its cause (minijinja keeps the details in the source chain).
fn describe(e: &minijinja::Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

/// `raise_exception(msg)`, which Hugging Face templates call to refuse a conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("the template raised: {msg}")))
}

/// Largest `tojson` indent a template may ask for (a template is file input: an indent of 10^15
/// would ask for that many bytes per line).
const TOJSON_MAX_INDENT: usize = 64;
/// Deepest nesting `tojson` serialises (it recurses once a level; a template can build a list
/// nested thousands deep).
const TOJSON_MAX_DEPTH: usize = 128;

/// Longest text `tojson` writes: the fuel charges its output only once it is written, so a lazy
/// `[[0] * 1000] * 10**6` would otherwise build gigabytes first (an allocation abort).
const TOJSON_MAX_BYTES: usize = 16 << 20;

fn check_size(out: &str) -> std::result::Result<(), minijinja::Error> {
    if out.len() > TOJSON_MAX_BYTES {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: output above {} MiB", TOJSON_MAX_BYTES >> 20)));
    }
    Ok(())
}

/// `tojson` as Hugging Face defines it: Python's `json.dumps(x, ensure_ascii=False, indent=…)`
/// — `", "` and `": "` between items, keys in insertion order, non-ASCII kept, no HTML escaping.
fn tojson(value: Value, indent: Option<usize>, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent = match indent {
        Some(n) => Some(n),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    if indent.is_some_and(|n| n > TOJSON_MAX_INDENT) {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: indent above {TOJSON_MAX_INDENT}")));
    }
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    python_dumps(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(out)
}

fn python_dumps(v: &Value, indent: Option<usize>, sort_keys: bool, depth: usize, out: &mut String) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind as K;
    if depth > TOJSON_MAX_DEPTH {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: nesting deeper than {TOJSON_MAX_DEPTH}")));
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    let quoted = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number => out.push_str(&v.to_string()),
        K::String => out.push_str(&quoted(v.as_str().unwrap_or_default())),
        K::Seq | K::Iterable => {
            // Item by item: a repeated list (`[0] * 10**8`) is lazy and costs no fuel until
            // something walks it.
            out.push('[');
            let mut any = false;
            for item in v.try_iter()? {
                out.push_str(if any { sep } else { "" });
                any = true;
                newline(out, depth + 1);
                python_dumps(&item, indent, sort_keys, depth + 1, out)?;
                check_size(out)?;
            }
            if any {
                newline(out, depth);
            }
            out.push(']');
        }
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                out.push_str(if i > 0 { sep } else { "" });
                newline(out, depth + 1);
                out.push_str(&quoted(&key.to_string()));
                out.push_str(": ");
                python_dumps(&v.get_item(key)?, indent, sort_keys, depth + 1, out)?;
                check_size(out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialise a {}", v.kind()))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None).unwrap();
        let chat = Chat::new(vec![]).with("x", serde_json::json!({"name": "café <b>", "args": [1, 2.5, true, null], "e": {}}));
        let got = t.render(&chat).unwrap();
        let want_compact = r#"{"name": "café <b>", "args": [1, 2.5, true, null], "e": {}}"#;
        let want_indented = "{\n  \"name\": \"café <b>\",\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"e\": {}\n}";
        assert_eq!(got, format!("{want_compact}|{want_indented}"));
    }

    #[test]
    fn tojson_refuses_huge_indents_and_deep_nesting() {
        let chat = Chat::new(vec![ChatMessage::user("hi")]);
        let huge = ChatTemplate::new("{{ messages | tojson(indent=1000000000000000) }}", None, None).unwrap();
        assert!(huge.render(&chat).is_err());
        let kw = ChatTemplate::new("{{ messages | tojson(indent=65) }}", None, None).unwrap();
        assert!(kw.render(&chat).is_err());
        let deep = "{% set ns = namespace(x=1) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}";
        let err = ChatTemplate::new(deep, None, None).unwrap().render(&chat).unwrap_err();
        assert!(err.to_string().contains("nesting deeper"), "{err}");
        let ok = "{% set ns = namespace(x=1) %}{% for i in range(100) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson(indent=64) }}";
        assert!(ChatTemplate::new(ok, None, None).unwrap().render(&chat).is_ok());
    }

    /// A template nesting a value 25 levels an instruction, `outer` × 40 times.
    fn nesting_template(outer: usize, then: &str) -> String {
        let (open, close) = ("[".repeat(25), "]".repeat(25));
        format!("{{% set ns = namespace(x=1) %}}{{% for i in range({outer}) %}}{{% for j in range(40) %}}{{% set ns.x = {open}ns.x{close} %}}{{% endfor %}}{{% endfor %}}{then}")
    }

    #[test]
    fn deep_values_render_or_fail_typed_without_overflowing_the_stack() {
        // 200 000 levels printed (the caller's 8 MB stack overflowed from ≈ 22 000).
        let t = ChatTemplate::new(nesting_template(200, "{{ ns.x }}"), None, None).unwrap();
        let out = t.render(&Chat::default()).unwrap();
        assert_eq!(out.len(), 2 * 200_000 + 1);
        assert!(out.starts_with("[[[") && out.ends_with("]]]"));
        // Nesting until the fuel runs out: a typed error, and the deepest value the fuel allows
        // is dropped on the rendering thread.
        let t = ChatTemplate::new(nesting_template(100_000, ""), None, None).unwrap();
        let err = t.render(&Chat::default()).unwrap_err();
        assert!(matches!(err, Error::ChatTemplate(ref m) if m.contains("fuel")), "{err}");
        // Wide lazy lists stop at tojson's output bound instead of building gigabytes.
        let t = ChatTemplate::new("{{ ([[0] * 1000] * 1000000) | tojson | length }}", None, None).unwrap();
        let err = t.render(&Chat::default()).unwrap_err();
        assert!(err.to_string().contains("tojson: output above"), "{err}");
        // Pretty-printers whose time the fuel does not bound are not there.
        for then in ["{{ ns.x | pprint }}", "{{ debug(ns.x) }}"] {
            let t = ChatTemplate::new(nesting_template(8, then), None, None);
            assert!(matches!(t.and_then(|t| t.render(&Chat::default())), Err(Error::ChatTemplate(_))), "{then}");
        }
    }

    #[test]
    fn long_chains_compile_off_the_callers_stack_and_wide_formats_are_refused() {
        // As long a chain as the source bound allows: compiled, rendered and dropped here (a
        // test thread has 2 MB of stack).
        let links = (TEMPLATE_MAX_BYTES - 16) / 4;
        let t = ChatTemplate::new(format!("{{{{ 1{} }}}}", " + 1".repeat(links)), None, None).unwrap();
        assert_eq!(t.render(&Chat::default()).unwrap(), (links + 1).to_string());
        drop(t);
        assert!(ChatTemplate::new(" ".repeat(TEMPLATE_MAX_BYTES + 1), None, None).is_err());
        for spec in ["{:>999999999999}", "{:.3000000000f}", "{:x<3000000000}", "{0:{1}}"] {
            let t = ChatTemplate::new(format!("{{{{ '{spec}'.format(1, 5) }}}}"), None, None).unwrap();
            let r = t.render(&Chat::default());
            assert!(spec == "{0:{1}}" || matches!(r, Err(Error::ChatTemplate(ref m)) if m.contains("wider")), "{spec}: {r:?}");
        }
        let fine = ChatTemplate::new("{{ '{:>8}|{:.2f}'.format('ab', 1.5) }}", None, None).unwrap();
        assert_eq!(fine.render(&Chat::default()).unwrap(), "      ab|1.50");
    }

    #[test]
    fn a_rendering_past_the_time_limit_is_an_error_and_disables_the_template() {
        // Comparing two deep lists is one instruction however deep they are: twenty
        // comparisons of 50 000 levels take far longer than the 50 ms allowed here.
        let (open, close) = ("[".repeat(25), "]".repeat(25));
        let nest = |v: &str| format!("{{% set ns.{v} = {open}ns.{v}{close} %}}");
        let src = format!(
            "{{% set ns = namespace(x=1, y=1) %}}{{% for i in range(50) %}}{{% for j in range(40) %}}{}{}{{% endfor %}}{{% endfor %}}{{% for i in range(20) %}}{{{{ ns.x == ns.y }}}}{{% endfor %}}",
            nest("x"),
            nest("y")
        );
        let mut t = ChatTemplate::new(src, None, None).unwrap();
        t.time_limit = std::time::Duration::from_millis(50);
        let err = t.render(&Chat::default()).unwrap_err();
        assert!(err.to_string().contains("ran past"), "{err}");
        let again = t.render(&Chat::default()).unwrap_err();
        assert!(again.to_string().contains("disabled"), "{again}");
    }

    #[test]
    fn python_string_methods_and_trimmed_blocks() {
        let src = "{% for m in messages %}\n  {% if m.content.strip().startswith('#') %}{{ m.content.split('#')[1].strip().upper() }}{% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let chat = Chat::new(vec![ChatMessage::user("  # title  "), ChatMessage::user("plain")]);
        assert_eq!(t.render(&chat).unwrap(), "TITLE");
    }

    #[test]
    fn failures_are_typed_errors() {
        assert!(matches!(ChatTemplate::new("{% for %}", None, None), Err(Error::ChatTemplate(_))));
        let raises = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        assert!(matches!(raises.render(&Chat::default()), Err(Error::ChatTemplate(m)) if m.contains("roles must alternate")));
        let endless = ChatTemplate::new("{% for i in range(1000000) %}{% for j in range(1000000) %}{{ i }}{% endfor %}{% endfor %}", None, None).unwrap();
        assert!(matches!(endless.render(&Chat::default()), Err(Error::ChatTemplate(_))), "fuel bounds a template that would not end");
        let undefined = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", None, None).unwrap();
        assert!(matches!(undefined.render(&Chat::new(vec![ChatMessage::user("x")])), Err(Error::ChatTemplate(_))));
    }
}
