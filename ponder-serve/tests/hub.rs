//! `ponder-serve --model owner/name` (a build with `--features hub`): the binary downloads the
//! repository from a hub on loopback (the library's `fake_hub`) into `--hub-cache` and serves it
//! under the repository's id. Bounded: the server is killed when the test ends, every wait has a
//! limit.
#![cfg(feature = "hub")]

#[path = "../../tests/fake_hub/mod.rs"]
mod fake_hub;

use fake_hub::{FakeHub, Repo};
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 exchange with `addr`: the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

#[test]
fn serves_a_hub_repository_by_its_id() {
    let tiny = Repo::from_dir(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-ouro"));
    let hub = FakeHub::start(BTreeMap::from([("ponder/tiny-ouro".to_string(), tiny)]));
    let cache = std::env::temp_dir().join(format!("ponder-serve-hub-test-{}", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_ponder-serve"))
        .args(["--model", "ponder/tiny-ouro", "--hub-endpoint", &hub.endpoint(), "--hub-cache"])
        .arg(&cache)
        .args(["--port", "0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Killed(child);
    let stderr = server.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(addr) = line.split_once(" on http://").map(|(_, a)| a.to_string()) {
                let _ = tx.send(addr);
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(120)).expect("the server did not start within 120 s");
    assert!(cache.join("models--ponder--tiny-ouro/snapshots").exists());

    let (status, models) = http(&addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{models}");
    assert!(models.contains("\"ponder/tiny-ouro\""), "{models}");
    let (status, body) = http(&addr, "POST", "/v1/completions", r#"{"model": "ponder/tiny-ouro", "prompt": "fn main", "max_tokens": 4, "temperature": 0}"#);
    assert_eq!(status, 200, "{body}");
    drop(server);
    let _ = std::fs::remove_dir_all(&cache);
}
