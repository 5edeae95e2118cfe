//! Chat prompts through the checkpoint's template, in the dialects of the families we serve
//! (Qwen3-style for SDAR, Ouro's thinking ChatML, LLaDA's Llama-3-style headers, Dream's
//! Qwen2.5 ChatML with a default system prompt) — templates written for these tests in those
//! styles — with the exact text and token ids; loading the template the ways checkpoints ship it;
//! typed errors for a model without a template and for a template that fails.

use ponder::chat::{Chat, ChatMessage, ChatTemplate};
use ponder::testing::{tiny_ouro_config, write_random_ouro};
use ponder::{EngineBuilder, Error, GenerationParams, Prompt};
use std::path::{Path, PathBuf};
use tokenizers::{AddedToken, Tokenizer};

const SPECIAL: [&str; 8] = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"];

const QWEN3: &str = r#"{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' + message.content.strip() + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}"#;

const OURO_THINKING: &str = r#"{% if messages[0].role != 'system' %}<|im_start|>system
You are a careful reasoner.<|im_end|>
{% endif %}
{% for m in messages %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
<think>
{% endif %}"#;

const LLADA: &str = r#"{{ bos_token }}{% for m in messages %}{% if loop.index0 % 2 == 1 and m.role == 'user' %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"#;

const DREAM: &str = r#"{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

fn conversation() -> Vec<ChatMessage> {
    vec![ChatMessage::user("What does `&mut` mean?"), ChatMessage::assistant("A unique borrow."), ChatMessage::user("And `&`?")]
}

/// The shipped tokenizer plus the dialects' special tokens; returns the directory of a tiny
/// random Ouro using it, with `tokenizer_config` written as given.
fn model_dir(tmp: &Path, name: &str, tokenizer_config: Option<serde_json::Value>) -> (PathBuf, Tokenizer) {
    let mut tok = Tokenizer::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro/tokenizer.json")).unwrap();
    let added: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
    tok.add_special_tokens(added).unwrap();
    let dir = tmp.join(name);
    write_random_ouro(&dir, &tiny_ouro_config(tok.get_vocab_size(true)), 3).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    if let Some(c) = tokenizer_config {
        std::fs::write(dir.join("tokenizer_config.json"), c.to_string()).unwrap();
    }
    (dir, tok)
}

/// Renders `chat` through an engine on a checkpoint whose tokenizer_config holds `template`,
/// checks the text, and that its token ids hold each special token as its one id and decode
/// back to the text; and that a chat request is admitted with exactly those ids.
fn check(template: &str, bos: Option<&str>, chat: Chat, want: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = serde_json::json!({ "chat_template": template, "eos_token": "<|endoftext|>" });
    if let Some(b) = bos {
        cfg["bos_token"] = b.into();
    }
    let (dir, tok) = model_dir(tmp.path(), "m", Some(cfg));
    let mut engine = EngineBuilder::new(&dir).build().unwrap();
    let text = engine.render_chat(&chat).unwrap();
    assert_eq!(text, want);
    let ids = engine.encode(&text).unwrap();
    for s in SPECIAL {
        let id = tok.token_to_id(s).unwrap();
        assert_eq!(ids.iter().filter(|&&t| t == id).count(), want.matches(s).count(), "{s} is one id each time it appears");
    }
    assert_eq!(tok.decode(&ids, false).unwrap(), want);
    let out = engine.generate([Prompt::Chat(chat)], &GenerationParams::greedy(3)).unwrap().remove(0).unwrap();
    assert_eq!(out.prompt_tokens, ids.len());
}

#[test]
fn qwen3_style_with_and_without_thinking() {
    let want = "<|im_start|>user\nWhat does `&mut` mean?<|im_end|>\n<|im_start|>assistant\nA unique borrow.<|im_end|>\n<|im_start|>user\nAnd `&`?<|im_end|>\n<|im_start|>assistant\n";
    check(QWEN3, None, Chat::new(conversation()), want);
    check(QWEN3, None, Chat::new(conversation()).with("enable_thinking", false), &format!("{want}<think>\n\n</think>\n\n"));
    let mut closed = Chat::new(conversation());
    closed.add_generation_prompt = false;
    check(QWEN3, None, closed, &want[..want.len() - "<|im_start|>assistant\n".len()]);
}

#[test]
fn ouro_thinking_chatml_with_a_default_system_prompt() {
    let want = "<|im_start|>system\nYou are a careful reasoner.<|im_end|>\n<|im_start|>user\nWhat does `&mut` mean?<|im_end|>\n<|im_start|>assistant\nA unique borrow.<|im_end|>\n<|im_start|>user\nAnd `&`?<|im_end|>\n<|im_start|>assistant\n<think>\n";
    check(OURO_THINKING, None, Chat::new(conversation()), want);
    let mut with_system = vec![ChatMessage::system("Be brief.")];
    with_system.extend(conversation());
    let want = want.replace("You are a careful reasoner.", "Be brief.");
    check(OURO_THINKING, None, Chat::new(with_system), &want);
}

#[test]
fn llada_llama3_headers_with_bos() {
    let want = "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat does `&mut` mean?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA unique borrow.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd `&`?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    check(LLADA, Some("<|startoftext|>"), Chat::new(conversation()), want);
}

#[test]
fn dream_qwen25_chatml_with_a_default_system_prompt() {
    let want = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat does `&mut` mean?<|im_end|>\n<|im_start|>assistant\nA unique borrow.<|im_end|>\n<|im_start|>user\nAnd `&`?<|im_end|>\n<|im_start|>assistant\n";
    check(DREAM, None, Chat::new(conversation()), want);
}

/// Checkpoints ship the template as a string, as a list of named templates, or as
/// chat_template.jinja (which wins); special tokens as strings or added-token objects.
#[test]
fn templates_load_the_ways_checkpoints_ship_them() {
    let tmp = tempfile::tempdir().unwrap();
    let chat = Chat::new(vec![ChatMessage::user("hi")]);
    let named = serde_json::json!({
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}[{{ messages[0].content }}]"}],
        "bos_token": {"content": "<|startoftext|>", "lstrip": false},
    });
    let (dir, _) = model_dir(tmp.path(), "named", Some(named));
    assert_eq!(EngineBuilder::new(&dir).build().unwrap().render_chat(&chat).unwrap(), "<|startoftext|>[hi]");
    std::fs::write(dir.join("chat_template.jinja"), "jinja:{{ messages | length }}").unwrap();
    assert_eq!(EngineBuilder::new(&dir).build().unwrap().render_chat(&chat).unwrap(), "jinja:1");
    // A template given to the builder replaces the checkpoint's.
    let own = ChatTemplate::new("own:{{ messages[0].role }}", None, None).unwrap();
    assert_eq!(EngineBuilder::new(&dir).chat_template(own).build().unwrap().render_chat(&chat).unwrap(), "own:user");
    // A tokenizer_config.json that does not parse is a typed load error.
    std::fs::write(dir.join("tokenizer_config.json"), "{ not json").unwrap();
    assert!(matches!(EngineBuilder::new(&dir).build(), Err(Error::BadConfig { .. })));
    // So is a template that does not compile.
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "{% for %}"}"#).unwrap();
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    assert!(matches!(EngineBuilder::new(&dir).build(), Err(Error::ChatTemplate(_))));
}

#[test]
fn chat_without_a_template_or_with_a_failing_one_is_a_typed_error_and_others_go_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (plain, _) = model_dir(tmp.path(), "plain", None);
    let mut engine = EngineBuilder::new(&plain).build().unwrap();
    assert!(!engine.has_chat_template());
    let refused = engine.add_request(Chat::new(conversation()), GenerationParams::greedy(2));
    assert!(matches!(refused, Err(Error::ChatTemplate(ref m)) if m.contains("no chat template")), "{refused:?}");
    let (dir, _) = model_dir(tmp.path(), "llada", Some(serde_json::json!({ "chat_template": LLADA, "bos_token": "<|startoftext|>" })));
    let mut engine = EngineBuilder::new(&dir).build().unwrap();
    let bad = vec![ChatMessage::user("a"), ChatMessage::user("b")];
    let outs = engine.generate([Prompt::Chat(Chat::new(bad)), Prompt::Chat(Chat::new(conversation()))], &GenerationParams::greedy(2)).unwrap();
    assert!(matches!(&outs[0], Err(Error::ChatTemplate(m)) if m.contains("roles must alternate")), "{:?}", outs[0]);
    assert_eq!(outs[1].as_ref().unwrap().token_ids.len(), 2);
    assert_eq!(engine.requests().kv().num_used_blocks(), 0);
}

/// Every dialect template over several conversations, with and without the generation prompt
/// and `enable_thinking`, rendered as Python's jinja2 renders it under Hugging Face's settings
/// (`tools/reference/chat_reference.py` → `tests/fixtures/chat_reference.json`); where jinja2
/// raises, so do we.
#[test]
fn rendering_agrees_with_jinja2() {
    #[derive(serde::Deserialize)]
    struct Case {
        template: String,
        conversation: String,
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
        kwargs: serde_json::Map<String, serde_json::Value>,
        text: Option<String>,
        error: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat_reference.json");
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let source = |name: &str| match name {
        "QWEN3" => QWEN3,
        "OURO_THINKING" => OURO_THINKING,
        "LLADA" => LLADA,
        "DREAM" => DREAM,
        other => panic!("unknown template {other}"),
    };
    assert!(fx.cases.len() >= 48);
    // Every template of this file has jinja2 cases (the fixture is made from them).
    let here: std::collections::BTreeSet<&str> = include_str!("chat.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("const "))
        .filter(|l| l.contains(": &str = r#\""))
        .filter_map(|l| l.split(':').next())
        .collect();
    let covered: std::collections::BTreeSet<&str> = fx.cases.iter().map(|c| c.template.as_str()).collect();
    assert_eq!(covered, here, "a template without jinja2 cases: run tools/reference/chat_reference.py");
    for c in fx.cases {
        let t = ChatTemplate::new(source(&c.template), Some("<|startoftext|>".into()), Some("<|endoftext|>".into())).unwrap();
        let chat = Chat { messages: c.messages, add_generation_prompt: c.add_generation_prompt, kwargs: c.kwargs };
        let what = format!("{} / {} / generation prompt {} / {:?}", c.template, c.conversation, c.add_generation_prompt, chat.kwargs);
        match (t.render(&chat), c.text, c.error) {
            (Ok(got), Some(want), _) => assert_eq!(got, want, "{what}"),
            (Err(Error::ChatTemplate(_)), None, Some(_)) => {}
            (got, want, err) => panic!("{what}: got {got:?}, jinja2 gave {want:?} / error {err:?}"),
        }
    }
}
