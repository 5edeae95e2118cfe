//! Checkpoints broken one field or one tensor at a time, for every family: every value of every
//! `config.json` / `generation_config.json` field replaced by numbers of every size and sign,
//! strings, null, booleans, lists and objects, or removed; every tensor dropped, grown, stored
//! as an integer dtype or a scalar, or filled with NaN; the shipped model's tokenizer config and
//! trained gate heads likewise, and the recorded depth and unmask-count traces. Building an
//! engine and generating from it never panics; a missing or mis-shaped tensor is `BadTensor`
//! naming it; a NaN-filled one builds and fails no more than its own requests.

mod common;
use candle_core::{DType, Device, Tensor};
use common::{caught, family_checkpoints};
use ponder::looped::gate::{LearnedLookahead, Preloop};
use ponder::{Engine, EngineBuilder, Error, GenerationParams};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// What a build and one short generation came to; `Err` holds a panic's message.
type Outcome = Result<ponder::Result<()>, String>;

fn serve(build: impl FnOnce() -> ponder::Result<Engine>) -> Outcome {
    caught(|| {
        let mut engine = build()?;
        // A request may fail (a context window of 1, non-finite logits); the call itself may not.
        engine.generate([vec![1u32, 2, 3, 4, 5]], &GenerationParams::greedy(3)).map(|_| ())
    })
}

fn engine(dir: &Path) -> ponder::Result<Engine> {
    EngineBuilder::new(dir).block_size(4).max_num_seqs(2).max_num_batched_tokens(256).kv_capacity_tokens(1024).build()
}

/// A copy of `src` (hard links) without `skip`, which the caller writes.
fn copy_without(src: &Path, dst: &Path, skip: &str) {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap();
        if f.file_name() != skip {
            std::fs::hard_link(f.path(), dst.join(f.file_name())).unwrap();
        }
    }
}

/// Paths (object keys, list indices) of every value in `v`, containers included.
fn json_paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m.iter().map(|(k, x)| (k.clone(), x)).collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, x)| (i.to_string(), x)).collect(),
        _ => return,
    };
    for (k, x) in children {
        at.push(k);
        out.push(at.clone());
        json_paths(x, at, out);
        at.pop();
    }
}

/// `v` with the value at `path` replaced by `x`, or removed (`None`; list items are nulled).
fn with_value(v: &Value, path: &[String], x: Option<Value>) -> Value {
    let mut v = v.clone();
    let (last, parents) = path.split_last().unwrap();
    let mut cur = &mut v;
    for k in parents {
        cur = if cur.is_array() { &mut cur[k.parse::<usize>().unwrap()] } else { &mut cur[k.as_str()] };
    }
    match (cur, x) {
        (Value::Object(m), None) => {
            m.remove(last);
        }
        (Value::Object(m), Some(x)) => {
            m.insert(last.clone(), x);
        }
        (Value::Array(a), x) => a[last.parse::<usize>().unwrap()] = x.unwrap_or(Value::Null),
        _ => unreachable!("paths lead through containers"),
    }
    v
}

fn replacement_values() -> Vec<Value> {
    let mut v: Vec<Value> = vec![0.into(), 1.into(), (-1).into(), 3.into(), 1_000_000.into(), (1u64 << 40).into(), u64::MAX.into()];
    v.extend([0.5, -0.5, 1e300].map(Value::from));
    v.extend(["x".into(), "".into(), Value::Null, true.into(), Value::Array(vec![]), serde_json::json!({})]);
    v
}

/// Every value of the JSON file `file` in `dir` replaced or removed; `run` builds and serves the
/// mutated copy. Returns the panics, labelled.
fn mutate_json(tmp: &Path, dir: &Path, file: &str, run: &dyn Fn(&Path) -> Outcome) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(dir.join(file)) else { return vec![] };
    let original: Value = serde_json::from_str(&text).unwrap();
    let mut paths = Vec::new();
    json_paths(&original, &mut vec![], &mut paths);
    let mut panics = Vec::new();
    for path in &paths {
        for x in replacement_values().into_iter().map(Some).chain([None]) {
            let label = format!("{} {file} {} = {}", dir.display(), path.join("."), x.as_ref().map_or("<removed>".into(), |x| x.to_string()));
            let case = tmp.join("case");
            copy_without(dir, &case, file);
            std::fs::write(case.join(file), with_value(&original, path, x).to_string()).unwrap();
            if let Err(msg) = run(&case) {
                panics.push(format!("{label}: {msg}"));
            }
            std::fs::remove_dir_all(&case).unwrap();
        }
    }
    panics
}

/// The ways a tensor is broken: (label, the tensor that replaces it; `None` drops it).
fn broken_tensors(t: &Tensor) -> Vec<(&'static str, Option<Tensor>)> {
    let mut grown = t.dims().to_vec();
    grown[0] += 1;
    vec![
        ("dropped", None),
        ("grown", Some(Tensor::zeros(grown, t.dtype(), &Device::Cpu).unwrap())),
        ("u8", Some(t.to_dtype(DType::U8).unwrap())),
        ("i64", Some(t.to_dtype(DType::I64).unwrap())),
        ("scalar", Some(Tensor::new(1f32, &Device::Cpu).unwrap())),
        ("nan", Some((t.ones_like().unwrap() * f64::NAN).unwrap())),
    ]
}

/// Every tensor of `file` in `dir` broken every way; `check` sees the outcome of serving the
/// copy. Returns what `check` objected to, labelled.
fn mutate_tensors(tmp: &Path, dir: &Path, file: &str, run: &dyn Fn(&Path) -> Outcome, check: &dyn Fn(&str, &str, Outcome) -> Option<String>) -> Vec<String> {
    let tensors = candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut failures = Vec::new();
    for name in names {
        for (how, replacement) in broken_tensors(&tensors[name]) {
            let case = tmp.join("case");
            copy_without(dir, &case, file);
            let mut broken: HashMap<String, Tensor> = tensors.clone();
            match replacement {
                Some(t) => broken.insert(name.clone(), t),
                None => broken.remove(name),
            };
            candle_core::safetensors::save(&broken, case.join(file)).unwrap();
            if let Some(why) = check(name, how, run(&case)) {
                failures.push(format!("{} {file} {name} {how}: {why}", dir.display()));
            }
            std::fs::remove_dir_all(&case).unwrap();
        }
    }
    failures
}

/// A broken model tensor: dropped, grown, integer or scalar is `BadTensor` naming it (Huginn's
/// head may be dropped: its embeddings are tied); NaN builds and serves.
fn model_tensor_verdict(family: &str, name: &str, how: &str, outcome: Outcome) -> Option<String> {
    match (how, outcome) {
        (_, Err(panic)) => Some(format!("panicked: {panic}")),
        ("nan", Ok(result)) => result.err().map(|e| format!("NaN weights must build and serve, got {e}")),
        ("dropped", Ok(Ok(()))) if family == "huginn" && name == "lm_head.weight" => None,
        (_, Ok(Err(Error::BadTensor { name: named, .. }))) if named == name => None,
        (_, Ok(other)) => Some(format!("expected BadTensor naming it, got {other:?}")),
    }
}

#[test]
fn broken_configs_and_tensors_never_panic_for_any_family() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (family, dir) in family_checkpoints(tmp.path()) {
        assert!(matches!(serve(|| engine(&dir)), Ok(Ok(()))), "{family}: the unbroken checkpoint serves");
        let serve_dir = |d: &Path| serve(|| engine(d));
        for file in ["config.json", "generation_config.json"] {
            failures.extend(mutate_json(tmp.path(), &dir, file, &serve_dir));
        }
        failures
            .extend(mutate_tensors(tmp.path(), &dir, "model.safetensors", &serve_dir, &|name, how, outcome| model_tensor_verdict(family, name, how, outcome)));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The shipped model's tokenizer config (chat template, special tokens) and its trained gate
/// heads, broken the same ways: rendering a chat and serving it, or loading a head and serving
/// with it, never panics; a broken head is refused with a typed error when it is loaded.
#[test]
fn broken_tokenizer_configs_and_gate_heads_never_panic() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-ouro");
    let tmp = tempfile::tempdir().unwrap();
    let chat = ponder::Chat::new(vec![ponder::ChatMessage::system("Be brief."), ponder::ChatMessage::user("What is a crate?")]);
    let serve_chat = |d: &Path| {
        caught(|| {
            let mut engine = EngineBuilder::new(d).max_num_seqs(1).build()?;
            engine.generate([chat.clone()], &GenerationParams::greedy(2)).map(|_| ())
        })
    };
    assert!(matches!(serve_chat(&shipped), Ok(Ok(()))), "the shipped model serves a chat");
    let mut failures = mutate_json(tmp.path(), &shipped, "tokenizer_config.json", &serve_chat);

    for (file, preloop) in [("lookahead_exit_gate.safetensors", false), ("preloop_exit_gate.safetensors", true)] {
        let serve_with_head = |d: &Path| -> Outcome {
            caught(|| {
                let head = d.join(file);
                let gate: Box<dyn ponder::looped::gate::ExitGate> =
                    if preloop { Box::new(Preloop::load(&head, 0.5, 1, 4)?) } else { Box::new(LearnedLookahead::load(&head, 0.5, 1, 4)?) };
                let mut engine = EngineBuilder::new(d)
                    .max_num_seqs(2)
                    .looped(|o| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(ponder::KvLayoutKind::LastExited).exit_gate_boxed(gate))
                    .build()?;
                engine.generate([vec![1u32, 2, 3, 4, 5]], &GenerationParams::greedy(3)).map(|_| ())
            })
        };
        let shipped_outcome = serve_with_head(&shipped);
        assert!(matches!(shipped_outcome, Ok(Ok(()))), "{file}: the shipped head serves: {shipped_outcome:?}");
        failures.extend(mutate_tensors(tmp.path(), &shipped, file, &serve_with_head, &|_, _, outcome| match outcome {
            Err(panic) => Some(format!("panicked: {panic}")),
            Ok(Err(Error::BadTensor { .. } | Error::InvalidOption(_))) => None,
            Ok(other) => Some(format!("a broken head must be refused, got {other:?}")),
        }));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The context window every family reads from its config must hold a token: 0 is `BadConfig`
/// at load, not an engine that refuses every request.
#[test]
fn a_context_window_of_zero_is_a_bad_config() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, dir) in family_checkpoints(tmp.path()) {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let mut cfg: Value = serde_json::from_str(&text).unwrap();
        let field = ["max_position_embeddings", "max_sequence_length", "block_size"]
            .into_iter()
            .find(|f| cfg[f].as_u64().is_some_and(|n| n > 64))
            .unwrap_or_else(|| panic!("{family}: no context field"));
        cfg[field] = 0.into();
        let case = tmp.path().join(format!("{family}-zero"));
        copy_without(&dir, &case, "config.json");
        std::fs::write(case.join("config.json"), cfg.to_string()).unwrap();
        match engine(&case) {
            Err(Error::BadConfig { reason, .. }) => assert!(reason.contains(field), "{family}: {reason}"),
            other => panic!("{family}: expected BadConfig for {field} = 0, got {:?}", other.err()),
        }
    }
}

/// Recorded traces (exit depths for the looped replay gate, unmask counts for the diffusion
/// replay policy) are files too: every value replaced or removed, loading and serving with the
/// trace never panics.
#[test]
fn broken_trace_files_never_panic() {
    use ponder::diffusion::{Replay as ReplayCounts, UnmaskTrace};
    use ponder::looped::gate::{DepthTrace, Replay as ReplayDepths};
    let tmp = tempfile::tempdir().unwrap();
    let checkpoints = family_checkpoints(tmp.path());
    let (ouro, sdar) = (checkpoints[0].1.clone(), checkpoints[2].1.clone());
    let traces = tmp.path().join("traces");
    std::fs::create_dir_all(&traces).unwrap();
    std::fs::write(traces.join("depths.json"), r#"{"depths": {"0": [1, 2, 4], "1": [3]}}"#).unwrap();
    std::fs::write(traces.join("counts.json"), r#"{"counts": {"0": [[1, 2], [3]], "1": [[2]]}}"#).unwrap();
    let serve_depths = |d: &Path| -> Outcome {
        caught(|| {
            let gate = ReplayDepths::new(DepthTrace::from_json_file(&d.join("depths.json"))?, 1, 4)?;
            let looped =
                |o: ponder::LoopedOptions| o.scheduler(ponder::SchedulerKind::Depth { refill: true }).kv_layout(ponder::KvLayoutKind::Shared).exit_gate(gate);
            let mut engine = EngineBuilder::new(&ouro).max_num_seqs(2).looped(looped).build()?;
            engine.generate([vec![1u32, 2, 3], vec![4u32, 5]], &GenerationParams::greedy(4)).map(|_| ())
        })
    };
    let serve_counts = |d: &Path| -> Outcome {
        caught(|| {
            let policy = ReplayCounts::new(UnmaskTrace::from_json_file(&d.join("counts.json"))?);
            let mut engine = EngineBuilder::new(&sdar).max_num_seqs(2).block_size(4).diffusion(|o| o.unmask_policy(policy)).build()?;
            engine.generate([vec![1u32, 2, 3], vec![4u32, 5]], &GenerationParams::greedy(12)).map(|_| ())
        })
    };
    assert!(matches!(serve_depths(&traces), Ok(Ok(()))), "the depth trace serves");
    assert!(matches!(serve_counts(&traces), Ok(Ok(()))), "the count trace serves");
    let mut failures = mutate_json(tmp.path(), &traces, "depths.json", &serve_depths);
    failures.extend(mutate_json(tmp.path(), &traces, "counts.json", &serve_counts));
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
