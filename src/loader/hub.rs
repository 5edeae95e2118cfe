//! Downloading a checkpoint from the Hugging Face hub (the `hub` feature), through `hf-hub`.
//!
//! What `hf-hub` 1.0 asks a hub for, and what we ask on top: the repository's top-level
//! listing (`GET /api/models/{repo}/tree/{revision}`), chosen to pick the files a model
//! needs; then `snapshot_download` of exactly those, which asks for the revision's commit
//! (`GET /api/models/{repo}/revision/{revision}` → `sha`), lists the tree at that commit
//! (`…/tree/{sha}?recursive=true`), and for each wanted file not yet in the cache's snapshot
//! sends `HEAD /{repo}/resolve/{sha}/{file}` (it needs `ETag` — the blob's name in the cache —
//! `X-Repo-Commit` and `Content-Length`) and then a `GET` of the same URL. A listed file whose
//! `HEAD` is a 404 is skipped without an error by `hf-hub`, so we check that every file we
//! asked for arrived.

use crate::{Error, HubError, Result};
use hf_hub::repository::RepoTreeEntry;
use hf_hub::HFError;
use std::path::PathBuf;

/// Where [`super::ModelDir::from_hub_with`] downloads from and caches to. Each field left
/// `None` is the hub's own default, as `hf-hub` resolves it.
#[derive(Clone, Default)]
pub struct HubOptions {
    /// The hub's base URL (a mirror, or a local server); default `HF_ENDPOINT`, else
    /// `https://huggingface.co`.
    pub endpoint: Option<String>,
    /// The cache directory, in the hub's layout (`models--owner--name/{blobs,refs,snapshots}`);
    /// default `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
    /// A branch, tag or commit; default `main`.
    pub revision: Option<String>,
    /// An access token, for private or gated repositories; default `HF_TOKEN`, else the token
    /// `hf auth login` saved.
    pub token: Option<String>,
}

impl std::fmt::Debug for HubOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubOptions")
            .field("endpoint", &self.endpoint)
            .field("cache_dir", &self.cache_dir)
            .field("revision", &self.revision)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

/// The files of the repository's top level a model reads, besides its safetensors.
const FILES: [&str; 6] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json"];

fn wanted(file: &str) -> bool {
    FILES.contains(&file) || file.ends_with(".safetensors")
}

/// Downloads what a model needs of `repo` into the cache; returns its snapshot directory.
pub(super) fn download(repo: &str, options: &HubOptions) -> Result<PathBuf> {
    let fail = |reason| Error::Hub { repo: repo.to_string(), reason };
    let (owner, name) = match repo.split_once('/') {
        Some((o, n)) if !o.is_empty() && !n.is_empty() && !n.contains('/') => (o, n),
        _ => return Err(Error::InvalidOption(format!("hub repo `{repo}` is not owner/name"))),
    };
    let mut builder = hf_hub::HFClient::builder();
    if let Some(e) = &options.endpoint {
        builder = builder.endpoint(e);
    }
    if let Some(d) = &options.cache_dir {
        builder = builder.cache_dir(d);
    }
    if let Some(t) = &options.token {
        builder = builder.token(t);
    }
    let client = builder.build_sync().map_err(|e| fail(HubError::Other(e.to_string())))?;
    let model = client.model(owner, name);
    let revision = options.revision.clone();
    let classify = |e: HFError| fail(kind(e, revision.as_deref()));

    let listing = match model.list_tree().maybe_revision(revision.clone()).send() {
        Ok(l) => l,
        Err(e) if unreachable(&e) => {
            // Offline: the snapshot the cache holds for this revision, if any.
            return match model.snapshot_download().maybe_revision(revision.clone()).local_files_only(true).send() {
                Ok(dir) => {
                    tracing::warn!(repo, error = %e, "hub unreachable; opening the cached snapshot {}", dir.display());
                    Ok(dir)
                }
                Err(_) => Err(classify(e)),
            };
        }
        Err(e) => return Err(classify(e)),
    };
    let files: Vec<String> = listing
        .into_iter()
        .filter_map(|entry| match entry {
            RepoTreeEntry::File { path, .. } if wanted(&path) => Some(path),
            _ => None,
        })
        .collect();
    // Exact names: `*` would reach into subdirectories (`original/consolidated.safetensors`).
    let patterns = files.iter().map(|f| glob_escape(f)).collect();
    let dir = model.snapshot_download().maybe_revision(revision.clone()).allow_patterns(patterns).send().map_err(classify)?;
    if let Some(missing) = files.iter().find(|f| !dir.join(f).exists()) {
        return Err(fail(HubError::FileNotFound(missing.clone())));
    }
    Ok(dir)
}

/// A file name as a glob that matches only itself.
fn glob_escape(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '{' | '}' | '\\' | '!') {
            s.push('\\');
        }
        s.push(c);
    }
    s
}

/// The hub cannot be reached: no connection, a timeout, or a server error after `hf-hub`'s
/// retries.
fn unreachable(e: &HFError) -> bool {
    match e {
        HFError::Request { source, .. } => source.is_connect() || source.is_timeout(),
        HFError::Http { context } => context.status.is_server_error(),
        _ => false,
    }
}

/// What `hf-hub`'s error means for a user. The hub names the case in `X-Error-Code`
/// (`RepoNotFound`, `RevisionNotFound`) where `hf-hub`'s variant cannot tell: the listing's
/// 404 or 401 is a plain HTTP error, and a repository that does not exist is a 401 to a client
/// without a token. Without a code, a 404 is a missing repository on the default revision and
/// a missing revision on a named one.
fn kind(e: HFError, revision: Option<&str>) -> HubError {
    let context = match &e {
        HFError::Http { context } | HFError::AuthRequired { context } | HFError::Forbidden { context } => Some(context),
        HFError::RevisionNotFound { context, .. } | HFError::RepoNotFound { context, .. } => context.as_ref(),
        _ => None,
    };
    let status = context.map(|c| c.status.as_u16());
    let revision_named = |e: &HFError| match e {
        HFError::RevisionNotFound { revision, .. } => revision.clone(),
        _ => revision.unwrap_or("main").to_string(),
    };
    match context.and_then(|c| c.error_code.as_deref()) {
        Some("RepoNotFound") => return HubError::RepoNotFound,
        Some("RevisionNotFound") => return HubError::RevisionNotFound(revision_named(&e)),
        _ => {}
    }
    match e {
        HFError::RepoNotFound { .. } => HubError::RepoNotFound,
        HFError::EntryNotFound { path, .. } => HubError::FileNotFound(path),
        HFError::AuthRequired { .. } | HFError::Forbidden { .. } => HubError::Unauthorized(e.to_string()),
        HFError::Http { .. } if matches!(status, Some(401 | 403)) => HubError::Unauthorized(e.to_string()),
        HFError::RevisionNotFound { .. } | HFError::Http { .. } if status == Some(404) => match revision {
            None => HubError::RepoNotFound,
            Some(_) => HubError::RevisionNotFound(revision_named(&e)),
        },
        e => HubError::Other(e.to_string()),
    }
}
