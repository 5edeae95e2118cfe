//! `ModelDir::from_hub_with` against a hub on loopback (`fake_hub`) that serves the shipped
//! tiny checkpoints in the hub's URL layout: the download fetches what a model needs and
//! nothing else, loads and generates as the local directory does, a second start comes from
//! the cache (and an offline one too), and a missing repository, revision or file is a typed
//! error. Every hub call runs on its own thread under a time limit.
#![cfg(feature = "hub")]

mod common;
mod fake_hub;

use fake_hub::{commit, FakeHub, Repo};
use ponder::config::ModelConfig;
use ponder::loader::{HubOptions, ModelDir};
use ponder::{EngineBuilder, Error, GenerationParams, HubError};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn asset(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

/// `ModelDir::from_hub_with(repo)` from `endpoint` into `cache`, on a thread of its own, bounded.
fn fetch(endpoint: &str, cache: &Path, repo: &str, revision: Option<&str>) -> ponder::Result<ModelDir> {
    let options = HubOptions { endpoint: Some(endpoint.into()), cache_dir: Some(cache.into()), revision: revision.map(Into::into), token: None };
    let repo = repo.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(ModelDir::from_hub_with(&repo, &options));
    });
    rx.recv_timeout(Duration::from_secs(120)).expect("the hub call did not end within 120 s")
}

/// The files the hub sent (GETs of `resolve/`), by name.
fn downloaded(hub: &FakeHub) -> BTreeSet<String> {
    hub.requests()
        .iter()
        .filter_map(|r| r.strip_prefix("GET "))
        .filter_map(|p| p.split_once("/resolve/"))
        .map(|(_, rest)| rest.split_once('/').unwrap().1.to_string())
        .collect()
}

/// Greedy tokens of the shipped prompt from the checkpoint in `dir`.
fn greedy(dir: &Path) -> Vec<u32> {
    let mut e = EngineBuilder::new(dir).build().unwrap();
    e.generate(["Ownership"], &GenerationParams::greedy(8)).unwrap().remove(0).unwrap().token_ids
}

#[test]
fn downloads_what_a_model_needs_then_starts_from_the_cache() {
    let repo = Repo::from_dir(&asset("tiny-ouro")).with("original/consolidated.safetensors", b"not for us");
    let hub = FakeHub::start(BTreeMap::from([("ponder/tiny-ouro".to_string(), repo)]));
    let cache = tempfile::tempdir().unwrap();

    let md = fetch(&hub.endpoint(), cache.path(), "ponder/tiny-ouro", None).unwrap();
    assert!(matches!(md.config, ModelConfig::Ouro(_)));
    assert_eq!(md.path, cache.path().join("models--ponder--tiny-ouro/snapshots").join(commit("ponder/tiny-ouro")));
    assert!(md.tokenizer_file.is_some());
    // The top level's config, tokenizer and safetensors; not the README, the training notes or
    // a subdirectory's safetensors.
    let want = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        "lookahead_exit_gate.safetensors",
        "preloop_exit_gate.safetensors",
    ];
    assert_eq!(downloaded(&hub), want.iter().map(|s| s.to_string()).collect());
    assert_eq!(std::fs::read(md.path.join("model.safetensors")).unwrap(), std::fs::read(asset("tiny-ouro/model.safetensors")).unwrap());
    assert_eq!(greedy(&md.path), greedy(&asset("tiny-ouro")));

    // A second start: hf-hub still asks the hub for the commit and the file list (with ours,
    // three API calls), but fetches no file, not even a HEAD.
    hub.clear();
    let again = fetch(&hub.endpoint(), cache.path(), "ponder/tiny-ouro", None).unwrap();
    assert_eq!(again.path, md.path);
    let requests = hub.requests();
    assert!(requests.iter().all(|r| r.starts_with("GET /api/models/ponder/tiny-ouro/")), "{requests:?}");
    assert_eq!(requests.len(), 3, "{requests:?}");

    // The hub gone: the cached snapshot opens; a repository never downloaded is an error.
    let endpoint = hub.endpoint();
    drop(hub);
    let offline = fetch(&endpoint, cache.path(), "ponder/tiny-ouro", None).unwrap();
    assert_eq!(offline.path, md.path);
    let never = fetch(&endpoint, cache.path(), "ponder/other", None).unwrap_err();
    assert!(matches!(never, Error::Hub { ref repo, reason: HubError::Other(_) } if repo == "ponder/other"), "{never}");
}

#[test]
fn a_sharded_checkpoint_downloads_its_index_and_every_shard() {
    let (tmp, dir) = common::tiny_dir(3);
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<_> = tensors.keys().cloned().collect();
    names.sort();
    let mut repo = Repo::from_dir(&dir).without("model.safetensors");
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let part: std::collections::HashMap<_, _> = chunk.iter().map(|n| (n.clone(), tensors[n].clone())).collect();
        let path = tmp.path().join(&file);
        candle_core::safetensors::save(&part, &path).unwrap();
        repo = repo.with(&file, &std::fs::read(&path).unwrap());
        for n in chunk {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    repo = repo.with("model.safetensors.index.json", serde_json::json!({ "metadata": {}, "weight_map": weight_map }).to_string().as_bytes());
    let hub = FakeHub::start(BTreeMap::from([("ponder/sharded".to_string(), repo)]));
    let cache = tempfile::tempdir().unwrap();

    let md = fetch(&hub.endpoint(), cache.path(), "ponder/sharded", None).unwrap();
    assert_eq!(md.weight_files.len(), 2);
    let got = downloaded(&hub);
    assert!(
        got.contains("model.safetensors.index.json") && got.contains("model-00001-of-00002.safetensors") && got.contains("model-00002-of-00002.safetensors"),
        "{got:?}"
    );
    let prompt = vec![vec![5, 9, 2]];
    let run = |d: &Path| EngineBuilder::new(d).build().unwrap().generate(prompt.clone(), &GenerationParams::greedy(6)).unwrap().remove(0).unwrap().token_ids;
    assert_eq!(run(&md.path), run(&dir));
}

#[test]
fn a_missing_repository_revision_or_access_is_a_typed_error() {
    let tiny = Repo::from_dir(&asset("tiny-ouro"));
    let gated = Repo { gated: true, ..tiny.clone() };
    let hub = FakeHub::start(BTreeMap::from([("ponder/tiny-ouro".to_string(), tiny), ("ponder/gated".to_string(), gated)]));
    let cache = tempfile::tempdir().unwrap();
    let hub_error = |repo: &str, revision: Option<&str>| match fetch(&hub.endpoint(), cache.path(), repo, revision) {
        Err(Error::Hub { repo: r, reason }) if r == repo => reason,
        other => panic!("{repo}: expected a hub error, got {other:?}"),
    };

    assert_eq!(hub_error("nobody/nothing", None), HubError::RepoNotFound);
    assert_eq!(hub_error("ponder/tiny-ouro", Some("v9")), HubError::RevisionNotFound("v9".into()));
    let gated = hub_error("ponder/gated", None);
    assert!(matches!(gated, HubError::Unauthorized(ref m) if m.contains("gated")), "{gated}");
    // The commit a branch is at is a revision too.
    assert!(fetch(&hub.endpoint(), cache.path(), "ponder/tiny-ouro", Some(&commit("ponder/tiny-ouro"))).is_ok());
    // Nothing was downloaded for the failures.
    assert!(!cache.path().join("models--nobody--nothing/snapshots").exists());
    for bad in ["tiny-ouro", "a/b/c", "/x"] {
        assert!(matches!(fetch(&hub.endpoint(), cache.path(), bad, None), Err(Error::InvalidOption(_))), "{bad}");
    }
}

#[test]
fn a_listed_file_the_hub_does_not_serve_or_no_config_is_a_typed_error() {
    let tiny = Repo::from_dir(&asset("tiny-ouro"));
    let mut unserved = tiny.clone().without("model.safetensors");
    unserved.unserved.push("model.safetensors".into());
    let no_config = tiny.clone().without("config.json");
    let hub = FakeHub::start(BTreeMap::from([("ponder/unserved".to_string(), unserved), ("ponder/no-config".to_string(), no_config)]));
    let cache = tempfile::tempdir().unwrap();

    // hf-hub skips a listed file whose HEAD is a 404; from_hub notices it is missing.
    let err = fetch(&hub.endpoint(), cache.path(), "ponder/unserved", None).unwrap_err();
    assert!(matches!(err, Error::Hub { reason: HubError::FileNotFound(ref f), .. } if f == "model.safetensors"), "{err}");
    assert!(hub.requests().iter().any(|r| r.starts_with("HEAD ") && r.ends_with("/model.safetensors")));

    // A repository without config.json downloads, and is no checkpoint: ModelDir::open's error.
    let err = fetch(&hub.endpoint(), cache.path(), "ponder/no-config", None).unwrap_err();
    assert!(matches!(err, Error::Io { ref path, .. } if path.ends_with("config.json")), "{err}");
}
