//! A Hugging Face hub on loopback for the `hub` feature's tests (std::net, one thread per
//! connection): the model repositories it is given, in the hub's URL layout, with the headers
//! `hf-hub` reads and the `X-Error-Code`s the hub sends. It logs every request. Each connection
//! has read and write timeouts; dropping the hub stops its accept loop and closes its port.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One model repository: the files it lists and serves, the files it lists but answers 404
/// for, and whether it asks for a token it never accepts (a gated repository).
#[derive(Clone, Default)]
pub struct Repo {
    pub files: BTreeMap<String, Vec<u8>>,
    pub unserved: Vec<String>,
    pub gated: bool,
}

impl Repo {
    /// The regular files at the top of `dir`.
    pub fn from_dir(dir: &Path) -> Self {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                files.insert(e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap());
            }
        }
        Self { files, ..Self::default() }
    }

    pub fn with(mut self, name: &str, bytes: &[u8]) -> Self {
        self.files.insert(name.into(), bytes.to_vec());
        self
    }

    pub fn without(mut self, name: &str) -> Self {
        self.files.remove(name);
        self
    }
}

/// The commit every repository's `main` is at: 40 hex digits from its id.
pub fn commit(repo: &str) -> String {
    format!("{:016x}{:016x}{:08x}", hash(repo.as_bytes()), hash(&[repo.as_bytes(), b"2"].concat()), hash(&[repo.as_bytes(), b"3"].concat()) as u32)
}

/// A file's ETag (its blob's name in the cache).
pub fn etag(bytes: &[u8]) -> String {
    format!("{:016x}{:016x}", hash(bytes), bytes.len())
}

fn hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

pub struct FakeHub {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeHub {
    /// A hub holding `repos` ("owner/name" → repository) on a free loopback port.
    pub fn start(repos: BTreeMap<String, Repo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (repos, log, stop) = (Arc::new(repos), Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (l, s) = (log.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (repos, log) = (repos.clone(), l.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &repos, &log);
                });
            }
        });
        Self { addr, log, stop, thread: Some(thread) }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far, as "METHOD /path?query", in arrival order.
    pub fn requests(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.log.lock().unwrap().clear();
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop, which then returns and closes the port.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Response {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

fn json(status: u16, value: serde_json::Value) -> Response {
    Response { status, headers: vec![("Content-Type", "application/json".into())], body: value.to_string().into_bytes() }
}

/// The hub's error answer: the case in `X-Error-Code`, the message in the body.
fn error(status: u16, code: &str, message: &str) -> Response {
    let mut r = json(status, serde_json::json!({ "error": message }));
    r.headers.push(("X-Error-Code", code.into()));
    r
}

fn serve(mut conn: TcpStream, repos: &BTreeMap<String, Repo>, log: &Mutex<Vec<String>>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 || head.len() > 64 << 10 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let mut line = text.lines().next().unwrap_or_default().split(' ');
    let (method, target) = (line.next().unwrap_or_default(), line.next().unwrap_or_default());
    log.lock().unwrap().push(format!("{method} {target}"));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let r = route(path, query, repos);
    let reason = match r.status {
        200 => "OK",
        401 => "Unauthorized",
        404 => "Not Found",
        _ => "Error",
    };
    let mut out = format!("HTTP/1.1 {} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n", r.status, r.body.len());
    for (k, v) in &r.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    conn.write_all(out.as_bytes())?;
    if method != "HEAD" {
        conn.write_all(&r.body)?;
    }
    conn.flush()
}

fn route(path: &str, query: &str, repos: &BTreeMap<String, Repo>) -> Response {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (owner, name, action, revision, file) = match segs.as_slice() {
        ["api", "models", o, n, a @ ("revision" | "tree"), rev] => (*o, *n, *a, *rev, String::new()),
        [o, n, "resolve", rev, file @ ..] if !file.is_empty() => (*o, *n, "resolve", *rev, file.join("/")),
        _ => return error(404, "NotFound", "no such route"),
    };
    let id = format!("{owner}/{name}");
    let Some(repo) = repos.get(&id) else { return error(404, "RepoNotFound", "Repository not found") };
    if repo.gated {
        return error(401, "GatedRepo", "Access to this gated repository is restricted");
    }
    let sha = commit(&id);
    if revision != "main" && revision != sha {
        return error(404, "RevisionNotFound", "Invalid rev id");
    }
    match action {
        "revision" => json(200, serde_json::json!({ "id": id, "sha": sha })),
        "tree" => {
            let recursive = query.split('&').any(|kv| kv == "recursive=true");
            let names: BTreeSet<&str> = repo.files.keys().map(String::as_str).chain(repo.unserved.iter().map(String::as_str)).collect();
            let mut entries = Vec::new();
            let mut dirs = BTreeSet::new();
            for n in names {
                if let Some((dir, _)) = n.split_once('/') {
                    if dirs.insert(dir) {
                        entries.push(serde_json::json!({ "type": "directory", "oid": etag(dir.as_bytes()), "path": dir }));
                    }
                    if !recursive {
                        continue;
                    }
                }
                let size = repo.files.get(n).map_or(0, Vec::len);
                entries.push(serde_json::json!({ "type": "file", "oid": etag(n.as_bytes()), "size": size, "path": n }));
            }
            json(200, serde_json::Value::Array(entries))
        }
        _ => match repo.files.get(&file) {
            Some(bytes) => Response { status: 200, headers: vec![("ETag", format!("\"{}\"", etag(bytes))), ("X-Repo-Commit", sha)], body: bytes.clone() },
            None => {
                let mut r = error(404, "EntryNotFound", "Entry not found");
                r.headers.push(("X-Repo-Commit", sha));
                r
            }
        },
    }
}
