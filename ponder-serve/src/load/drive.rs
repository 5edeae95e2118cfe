//! The two drivers: the same arrivals sent through the in-process handle or over HTTP, each
//! request's token times recorded where its events are read.

use super::{Arrival, Record};
use futures_util::StreamExt;
use ponder::{EngineHandle, Event, FinishReason, GenerationParams, RequestId};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const UNFINISHED: &str = "not finished within the run's limit";

/// Sends `arrivals` through `engine` at their times (one thread per request, spawned when it
/// is due); requests still running `limit` after the last arrival are aborted and recorded as
/// unfinished, so a stalled engine ends the run instead of hanging it.
pub fn in_process(engine: &EngineHandle, arrivals: &[Arrival], limit: Duration) -> Vec<Record> {
    let start = Instant::now();
    let running: Mutex<Vec<RequestId>> = Mutex::new(Vec::new());
    let records = std::thread::scope(|s| {
        let mut threads = Vec::with_capacity(arrivals.len());
        for a in arrivals {
            if let Some(wait) = (start + a.at).checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let running = &running;
            threads.push(s.spawn(move || {
                let mut r = Record { sent: a.at, ..Record::default() };
                let params = GenerationParams { ignore_eos: true, ..GenerationParams::greedy(a.max_tokens) };
                let stream = match engine.submit(a.prompt.clone(), params) {
                    Ok(stream) => stream,
                    Err(e) => {
                        r.error = Some(e.to_string());
                        return r;
                    }
                };
                running.lock().unwrap_or_else(|e| e.into_inner()).push(stream.id);
                for ev in stream {
                    match ev {
                        Event::Token { .. } => r.tokens.push(start.elapsed()),
                        Event::Finished { reason, .. } => {
                            r.ended = Some(start.elapsed());
                            r.error = match reason {
                                FinishReason::Error(m) => Some(m),
                                FinishReason::Aborted => Some(UNFINISHED.into()),
                                _ => None,
                            };
                        }
                    }
                }
                r
            }));
        }
        let deadline = Instant::now() + limit;
        while threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if threads.iter().any(|t| !t.is_finished()) {
            for &id in running.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = engine.abort(id);
            }
        }
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Record { error: Some("the request's thread panicked".into()), ..Record::default() })).collect()
    });
    records
}

/// Sends `arrivals` to the server at `base` (`POST /v1/completions`, streamed, prompt as ids,
/// greedy, `ignore_eos`) at their times; a request not finished `limit` after the last arrival
/// is dropped (the server aborts it) and recorded as unfinished.
pub async fn http(client: &reqwest::Client, base: &str, model: &str, arrivals: &[Arrival], limit: Duration) -> Vec<Record> {
    let start = tokio::time::Instant::now();
    let last = arrivals.iter().map(|a| a.at).max().unwrap_or_default();
    let deadline = start + last + limit;
    let tasks: Vec<_> = arrivals
        .iter()
        .map(|a| {
            let (client, url, a) = (client.clone(), format!("{base}/v1/completions"), a.clone());
            let body =
                serde_json::json!({"model": model, "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": true, "stream": true});
            tokio::spawn(async move {
                tokio::time::sleep_until(start + a.at).await;
                let mut r = Record { sent: a.at, ..Record::default() };
                match tokio::time::timeout_at(deadline, stream_one(&client, &url, &body, start, &mut r)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => r.error = Some(e),
                    Err(_) => r.error = Some(UNFINISHED.into()),
                }
                r
            })
        })
        .collect();
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await.unwrap_or_else(|e| Record { error: Some(format!("the request's task failed: {e}")), ..Record::default() }));
    }
    records
}

/// One streamed completion: each `data:` event's tokens timed on arrival. A chunk's token
/// count is the length of its `ponder` compute list (one per token), else 1 for non-empty text.
async fn stream_one(client: &reqwest::Client, url: &str, body: &serde_json::Value, start: tokio::time::Instant, r: &mut Record) -> Result<(), String> {
    let response = client.post(url).json(body).send().await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        let status = response.status();
        return Err(format!("HTTP {status}: {}", response.text().await.unwrap_or_default()));
    }
    let mut bytes = response.bytes_stream();
    let mut pending = String::new();
    while let Some(chunk) = bytes.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let now = start.elapsed();
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim) {
                if data == "[DONE]" {
                    r.ended = Some(now);
                    return Ok(());
                }
                let v: serde_json::Value = serde_json::from_str(data).map_err(|e| format!("a bad event ({e}): {data}"))?;
                if let Some(e) = v.get("error") {
                    return Err(e.to_string());
                }
                let Some(choice) = v["choices"].get(0) else { continue };
                let steps = ["loop_steps", "denoise_steps"].iter().find_map(|k| choice["ponder"][k].as_array().map(Vec::len));
                let n = steps.unwrap_or(usize::from(choice["text"].as_str().is_some_and(|t| !t.is_empty())));
                r.tokens.extend(std::iter::repeat_n(now, n));
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}
