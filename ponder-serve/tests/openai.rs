//! The server on loopback, driven over HTTP as an OpenAI client drives it: answers equal the
//! engine's own output for the same request, streams end as OpenAI's do, and bad requests get a
//! 400 naming the field. Every test binds 127.0.0.1:0 and is bounded in time.

use ponder::{EngineBuilder, GenerationParams};
use ponder_serve::{router, AppState, Defaults, Limits};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

fn asset(name: &str) -> String {
    format!("{}/../assets/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A server for `model` on a free loopback port; it stops with the test's runtime.
async fn serve(model: &str, temperature: f32) -> String {
    serve_limited(model, temperature, Limits { max_in_flight: usize::MAX, request_timeout: None }).await
}

/// [`serve`] under `limits`.
async fn serve_limited(model: &str, temperature: f32, limits: Limits) -> String {
    serve_with(EngineBuilder::new(asset(model)).max_num_seqs(4), model, temperature, limits).await
}

/// A server for the engine `builder` makes.
async fn serve_with(builder: EngineBuilder, model: &str, temperature: f32, limits: Limits) -> String {
    let engine = builder.spawn().unwrap();
    let state = Arc::new(AppState::new(engine, Defaults { model: model.into(), max_tokens: 16, temperature }, limits));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(state, 1 << 20)).await.unwrap() });
    format!("http://{addr}")
}

/// What `Engine::generate` gives for the same prompt, greedy.
fn engine_text(model: &str, prompt: ponder::Prompt, max_tokens: usize) -> String {
    engine_text_with(model, prompt, &GenerationParams::greedy(max_tokens))
}

fn engine_text_with(model: &str, prompt: ponder::Prompt, params: &GenerationParams) -> String {
    let mut e = EngineBuilder::new(asset(model)).build().unwrap();
    e.generate([prompt], params).unwrap().remove(0).unwrap().text
}

async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The `data:` payloads of a server-sent event stream, in order.
async fn stream(base: &str, path: &str, body: Value) -> Vec<String> {
    let text = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await.unwrap().text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A gauge or counter of a `/metrics` scrape.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.parse().ok())
}

/// Scrapes `/metrics` until the engine holds no request and no KV block (aborts land at the
/// engine's next step), asserts it does, and returns the last scrape.
async fn engine_emptied(client: &reqwest::Client, base: &str) -> String {
    const EMPTY: [&str; 3] = ["ponder_requests_running", "ponder_requests_waiting", "ponder_kv_blocks_used"];
    let mut text = String::new();
    for _ in 0..200 {
        text = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        if EMPTY.iter().all(|g| gauge(&text, g) == Some(0.0)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for name in EMPTY {
        assert_eq!(gauge(&text, name), Some(0.0), "{name}:\n{text}");
    }
    text
}

async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), f).await.expect("the test ran past its time bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_equal_the_engine_streamed_or_not() {
    bounded(async {
        for model in ["tiny-ouro", "tiny-sdar"] {
            let base = serve(model, 0.0).await;
            let (status, r) = post(&base, "/v1/completions", json!({"model": model, "prompt": "Ownership in Rust", "max_tokens": 12, "temperature": 0})).await;
            assert_eq!(status, 200, "{r}");
            let want = engine_text(model, "Ownership in Rust".into(), 12);
            assert_eq!(r["choices"][0]["text"], want, "{model}");
            assert_eq!(r["usage"]["completion_tokens"], 12);
            let key = if model == "tiny-ouro" { "loop_steps" } else { "denoise_steps" };
            assert_eq!(r["choices"][0]["ponder"][key].as_array().map(Vec::len), Some(12), "{model}: {r}");

            let chat = json!({"model": model, "messages": [{"role": "user", "content": "What is a trait?"}], "max_completion_tokens": 10, "temperature": 0});
            let (status, whole) = post(&base, "/v1/chat/completions", chat.clone()).await;
            assert_eq!(status, 200, "{whole}");
            let mut streamed = chat;
            streamed["stream"] = json!(true);
            streamed["stream_options"] = json!({"include_usage": true});
            let events = stream(&base, "/v1/chat/completions", streamed).await;
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
            let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
            assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap(), "{model}: streamed and whole differ");
            assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
            let usage = chunks.last().unwrap();
            assert_eq!((usage["choices"].as_array().map(Vec::len), &usage["usage"]), (Some(0), &whole["usage"]));
            assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));

            // Sampled, seeded: the engine's tokens for the same parameters (both families sample).
            let body = json!({"model": model, "prompt": "Ownership in Rust", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7});
            let (status, r) = post(&base, "/v1/completions", body).await;
            assert_eq!(status, 200, "{r}");
            let sampling = ponder::SamplingParams { temperature: 0.9, top_k: Some(40), top_p: Some(0.95), seed: Some(7) };
            let want = engine_text_with(model, "Ownership in Rust".into(), &GenerationParams { sampling, ..GenerationParams::greedy(12) });
            assert_eq!(r["choices"][0]["text"], want, "{model}: sampled");
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_400_naming_the_field() {
    bounded(async {
        let base = serve("tiny-ouro", 1.0).await;
        let cases = [
            (json!({"model": "tiny-ouro", "prompt": "x", "temprature": 0.5}), 400, "temprature"),
            (json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": "ten"}), 400, "max_tokens"),
            (json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
            (json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 1_000_000}), 400, "max_tokens"),
            (json!({"model": "tiny-ouro", "prompt": "x", "temperature": -1}), 400, "temperature"),
            (json!({"model": "tiny-ouro", "prompt": "x", "top_p": 0}), 400, "top_p"),
            (json!({"model": "tiny-ouro", "prompt": "x", "n": 2}), 400, "n"),
            (json!({"model": "tiny-ouro", "prompt": "x", "logprobs": 6}), 400, "logprobs"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "top_logprobs"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}), 400, "top_logprobs"),
            (json!({"model": "tiny-ouro", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
            (json!({"model": "tiny-ouro", "prompt": "x", "stream_options": {"include_usage": true}}), 400, "stream_options"),
            (json!({"model": "tiny-ouro", "prompt": [1, 2, 1_000_000]}), 400, "prompt"),
            (json!({"model": "other", "prompt": "x"}), 404, "model"),
            // Type errors in the fields both endpoints share name the field, as the endpoint's own do.
            (json!({"model": "tiny-ouro", "prompt": "x", "temperature": "hot"}), 400, "temperature"),
            (json!({"model": "tiny-ouro", "prompt": "x", "stream": "yes"}), 400, "stream"),
            (json!({"model": "tiny-ouro", "prompt": "x", "stop": [1, 2]}), 400, "stop"),
            (json!({"model": "tiny-ouro", "prompt": "x", "seed": -1}), 400, "seed"),
            (json!({"model": "tiny-ouro", "prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}), 400, "stream_options.include_usage"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "x"}], "top_k": -1}), 400, "top_k"),
            // A missing field is named.
            (json!({"prompt": "x"}), 400, "model"),
            (json!({"model": "tiny-ouro", "max_tokens": 2}), 400, "prompt"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1_000_000}), 400, "max_tokens"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1_000_000}), 400, "max_completion_tokens"),
            // Over the context window: the prompt where it alone fills the window, else the output's bound.
            (json!({"model": "tiny-ouro", "prompt": vec![5; 3000], "max_tokens": 2}), 400, "prompt"),
            (json!({"model": "tiny-ouro", "prompt": vec![5; 2040], "max_tokens": 100}), 400, "max_tokens"),
            (json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "word ".repeat(4000)}], "max_tokens": 2}), 400, "messages"),
        ];
        for (body, status, field) in cases {
            let path = if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
            let (got, r) = post(&base, path, body.clone()).await;
            assert_eq!((got, r["error"]["param"].as_str()), (status, Some(field)), "{body} → {r}");
            assert!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
        let (got, r) = post(&base, "/v1/chat/completions", json!({"model": "tiny-ouro", "messages": [{"role": "wizard", "content": "x"}]})).await;
        assert_eq!((got, r["error"]["param"].as_str()), (400, Some("messages[0].role")), "{r}");
        let raw = reqwest::Client::new().post(format!("{base}/v1/completions")).body("{not json").send().await.unwrap();
        assert_eq!(raw.status().as_u16(), 400);
        // The server still serves after all of that.
        let (ok, _) = post(&base, "/v1/completions", json!({"model": "tiny-ouro", "prompt": "fn main", "max_tokens": 2, "seed": 7})).await;
        assert_eq!(ok, 200);
    })
    .await
}

/// A body that is OpenAI's error object for a client error.
fn assert_api_error(body: &str) {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
}

/// Writes `request` as it is on one connection and reads the answer to its end: its status and
/// body (a response with a length, as the server's errors are).
async fn raw_http(addr: &str, request: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

/// What the router answers before any handler — no such route, a method a route does not take,
/// a body over the limit (by its length, or sent in chunks without one) — is OpenAI's error
/// object too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_before_the_handlers_are_json_too() {
    bounded(async {
        let base = serve("tiny-ouro", 1.0).await;
        let client = reqwest::Client::new();
        let requests = [
            (client.get(format!("{base}/v1/completions")), 405),
            (client.put(format!("{base}/v1/chat/completions")), 405),
            (client.post(format!("{base}/v1/nope")), 404),
        ];
        for (request, status) in requests {
            let r = request.send().await.unwrap();
            assert_eq!(r.status().as_u16(), status);
            if status == 405 {
                assert!(r.headers().contains_key("allow"), "{:?}", r.headers());
            }
            assert_api_error(&r.text().await.unwrap());
        }
        // Over the 1 MiB limit: refused by its length before the body is sent, and sent in chunks
        // without a length (refused as it is read; only a little past the limit, so the client
        // has written it all when the answer comes).
        let addr = base.trim_start_matches("http://");
        let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n";
        let by_length = format!("{head}Content-Length: {}\r\n\r\n", 3 << 20).into_bytes();
        let chunk = vec![b' '; (1 << 20) + (16 << 10)];
        let mut chunked = format!("{head}Transfer-Encoding: chunked\r\n\r\n{:x}\r\n", chunk.len()).into_bytes();
        chunked.extend_from_slice(&chunk);
        chunked.extend_from_slice(b"\r\n0\r\n\r\n");
        for request in [by_length, chunked] {
            let (status, body) = raw_http(addr, &request).await;
            assert_eq!(status, 413, "{body}");
            assert_api_error(&body);
        }
        let (ok, _) = post(&base, "/v1/completions", json!({"model": "tiny-ouro", "prompt": "fn main", "max_tokens": 2})).await;
        assert_eq!(ok, 200);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_does_not_stop_the_others() {
    bounded(async {
        let base = serve("tiny-ouro", 0.0).await;
        let client = reqwest::Client::new();
        let long = json!({"model": "tiny-ouro", "prompt": "Traits", "max_tokens": 400, "ignore_eos": true, "stream": true});
        for _ in 0..3 {
            let mut r = client.post(format!("{base}/v1/completions")).json(&long).send().await.unwrap();
            assert!(r.chunk().await.unwrap().is_some(), "the stream starts");
            drop(r); // the client goes away
        }
        let (status, r) = post(&base, "/v1/completions", json!({"model": "tiny-ouro", "prompt": "Closures", "max_tokens": 8, "temperature": 0})).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["text"], engine_text("tiny-ouro", "Closures".into(), 8));
        // The requests of the clients that left are aborted and their KV freed.
        let text = engine_emptied(&client, &base).await;
        assert!(gauge(&text, "ponder_kv_blocks_total").is_some_and(|n| n > 0.0));
        assert!(gauge(&text, "ponder_generated_tokens_total").is_some_and(|n| n >= 8.0));
        assert!(text.contains("ponder_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4"), "{text}");
        assert!(text.contains("ponder_launches_total{stage=\"decode\"}"), "{text}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_answers_429_with_retry_after() {
    bounded(async {
        let base = serve_limited("tiny-ouro", 0.0, Limits { max_in_flight: 1, request_timeout: None }).await;
        let client = reqwest::Client::new();
        let long = json!({"model": "tiny-ouro", "prompt": "Traits", "max_tokens": 400, "ignore_eos": true, "stream": true});
        let mut held = client.post(format!("{base}/v1/completions")).json(&long).send().await.unwrap();
        assert!(held.chunk().await.unwrap().is_some());
        let full = client.post(format!("{base}/v1/completions")).json(&json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 2})).send().await.unwrap();
        assert_eq!(full.status().as_u16(), 429);
        assert_eq!(full.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let body: Value = full.json().await.unwrap();
        assert_eq!(body["error"]["code"], "server_busy");
        drop(held); // its request is aborted at its next token and its place given back
        let mut status = 0;
        for _ in 0..100 {
            let r = client.post(format!("{base}/v1/completions")).json(&json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 2})).send().await.unwrap();
            status = r.status().as_u16();
            if status == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(status, 200, "the place of the client that left is never given back");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_time_limit_ends_and_frees_its_place() {
    bounded(async {
        let limits = Limits { max_in_flight: 1, request_timeout: Some(Duration::from_millis(300)) };
        let base = serve_limited("tiny-ouro", 0.0, limits).await;
        // The one place is given back once the engine has aborted the request that held it.
        let place_freed = || async {
            for _ in 0..100 {
                if post(&base, "/v1/completions", json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 2})).await.0 == 200 {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        };
        let long = json!({"model": "tiny-ouro", "prompt": "Traits", "max_tokens": 1500, "ignore_eos": true});
        let (status, r) = post(&base, "/v1/completions", long.clone()).await;
        assert_eq!((status, r["error"]["code"].as_str()), (504, Some("timeout")), "{r}");
        assert!(place_freed().await);
        let mut streamed = long;
        streamed["stream"] = json!(true);
        let events = stream(&base, "/v1/completions", streamed).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
        assert!(events[events.len() - 2].contains("\"timeout\""), "{:?}", &events[events.len() - 2]);
        assert!(place_freed().await);
    })
    .await
}

/// 200 concurrent streaming requests from 8 client tasks: a third leave after their first chunk,
/// a tenth are malformed. Every other one streams all its tokens to `[DONE]`, and afterwards the
/// engine holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_clients_some_leaving_some_malformed() {
    bounded(async {
        let limits = Limits { max_in_flight: usize::MAX, request_timeout: None };
        let base = serve_with(EngineBuilder::new(asset("tiny-ouro")).max_num_seqs(32), "tiny-ouro", 0.0, limits).await;
        let client = reqwest::Client::new();
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (base, client) = (base.clone(), client.clone());
                tokio::spawn(async move {
                    let requests = (0..25).map(|k| {
                        let (base, client, i) = (base.clone(), client.clone(), t * 25 + k);
                        async move {
                            let mut body = json!({"model": "tiny-ouro", "prompt": format!("Request {i} about traits"), "max_tokens": 6, "ignore_eos": true, "stream": true});
                            if i % 10 == 0 {
                                body["temperature"] = json!("hot");
                            }
                            let mut r = client.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
                            if i % 10 == 0 {
                                return (r.status().as_u16() == 400, "malformed");
                            }
                            if i % 3 == 0 {
                                let started = r.chunk().await.unwrap().is_some();
                                drop(r);
                                return (started, "left");
                            }
                            let text = r.text().await.unwrap();
                            let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                            let tokens = events.iter().filter(|e| e.contains("\"loop_steps\"")).count();
                            (events.last() == Some(&"[DONE]") && tokens == 6 && text.contains("\"finish_reason\":\"length\""), "served")
                        }
                    });
                    futures_util::future::join_all(requests).await
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.extend(t.await.unwrap());
        }
        assert_eq!(outcomes.len(), 200);
        let failed: Vec<_> = outcomes.iter().enumerate().filter(|(_, (ok, _))| !ok).collect();
        assert!(failed.is_empty(), "requests that did not end as they should: {failed:?}");
        let served = outcomes.iter().filter(|(_, kind)| *kind == "served").count();
        assert!(served >= 100, "{served} served");
        engine_emptied(&client, &base).await;
    })
    .await
}

/// A stock OpenAI client (the `async-openai` crate), unchanged, against the server on the tiny
/// Ouro and the tiny SDAR: completions and chat, whole and streamed, equal the engine's greedy
/// output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_openai_client_gets_the_engines_answers() {
    bounded(async {
        for model in ["tiny-ouro", "tiny-sdar"] {
            stock_client_on(model).await;
        }
    })
    .await
}

async fn stock_client_on(model: &str) {
    use async_openai::config::OpenAIConfig;
    use async_openai::types::{ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs, CreateCompletionRequestArgs};
    use futures_util::StreamExt;
    {
        let base = serve(model, 0.0).await;
        let client = async_openai::Client::with_config(OpenAIConfig::new().with_api_base(format!("{base}/v1")).with_api_key("unused"));
        let want = engine_text(model, "Ownership in Rust".into(), 12);
        let request = CreateCompletionRequestArgs::default().model(model).prompt("Ownership in Rust").max_tokens(12_u32).temperature(0.0).build().unwrap();
        let whole = client.completions().create(request.clone()).await.unwrap();
        assert_eq!(whole.choices[0].text, want);
        assert_eq!(whole.usage.as_ref().map(|u| u.completion_tokens), Some(12));
        let mut chunks = client.completions().create_stream(request).await.unwrap();
        let mut streamed = String::new();
        while let Some(chunk) = chunks.next().await {
            streamed += &chunk.unwrap().choices.iter().map(|c| c.text.clone()).collect::<String>();
        }
        assert_eq!(streamed, want);

        let message = ChatCompletionRequestUserMessageArgs::default().content("What is a trait?").build().unwrap();
        let chat =
            CreateChatCompletionRequestArgs::default().model(model).messages([message.into()]).max_completion_tokens(10_u32).temperature(0.0).build().unwrap();
        let whole = client.chat().create(chat.clone()).await.unwrap();
        let content = whole.choices[0].message.content.clone().unwrap();
        assert!(!content.is_empty());
        let mut chunks = client.chat().create_stream(chat).await.unwrap();
        let mut streamed = String::new();
        while let Some(chunk) = chunks.next().await {
            for c in chunk.unwrap().choices {
                streamed += c.delta.content.as_deref().unwrap_or("");
            }
        }
        assert_eq!(streamed, content);

        // Log-probabilities (looped models) parse into the client's own types.
        if model == "tiny-ouro" {
            let message = ChatCompletionRequestUserMessageArgs::default().content("What is a trait?").build().unwrap();
            let chat = CreateChatCompletionRequestArgs::default()
                .model(model)
                .messages([message.into()])
                .max_completion_tokens(6_u32)
                .temperature(0.0)
                .logprobs(true)
                .top_logprobs(2)
                .build()
                .unwrap();
            let whole = client.chat().create(chat).await.unwrap();
            let content = whole.choices[0].logprobs.as_ref().and_then(|l| l.content.clone()).unwrap();
            assert_eq!(content.len(), 6);
            assert!(content.iter().all(|t| t.top_logprobs.len() == 2 && t.logprob == t.top_logprobs[0].logprob));
        }
        let models = client.models().list().await.unwrap();
        assert_eq!(models.data[0].id, model);
    }
}

/// Log-probabilities in both APIs' shapes, whole and streamed, equal the engine's for the same
/// request; a diffusion model refuses them with a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_engines_in_both_shapes() {
    bounded(async {
        let base = serve("tiny-ouro", 0.0).await;
        let mut e = EngineBuilder::new(asset("tiny-ouro")).build().unwrap();
        let want = e.generate(["Ownership in Rust"], &GenerationParams { logprobs: Some(3), ..GenerationParams::greedy(8) }).unwrap().remove(0).unwrap();
        let close = |got: &Value, want: f32| (got.as_f64().unwrap() as f32 - want).abs() < 1e-4;

        let body = json!({"model": "tiny-ouro", "prompt": "Ownership in Rust", "max_tokens": 8, "temperature": 0, "logprobs": 3});
        let (status, r) = post(&base, "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{r}");
        let l = &r["choices"][0]["logprobs"];
        let tokens: Vec<&str> = l["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens.concat(), r["choices"][0]["text"].as_str().unwrap(), "the tokens spell the text");
        let offsets: Vec<u64> = l["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).zip(&tokens).all(|(w, t)| w[1] == w[0] + t.len() as u64));
        for (i, lp) in want.logprobs.iter().enumerate() {
            assert!(close(&l["token_logprobs"][i], *lp), "{i}: {} vs {lp}", l["token_logprobs"][i]);
            assert_eq!(l["top_logprobs"][i].as_object().unwrap().len(), 3);
        }
        // Streamed: one token's lists per chunk, the same values.
        let mut streamed = body;
        streamed["stream"] = json!(true);
        let events = stream(&base, "/v1/completions", streamed).await;
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let per_chunk: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].get(0)).collect();
        assert_eq!(per_chunk.len(), 8);
        assert!(per_chunk.iter().zip(&want.logprobs).all(|(g, w)| close(g, *w)));

        let chat = json!({"model": "tiny-ouro", "messages": [{"role": "user", "content": "What is a trait?"}], "max_completion_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2});
        let (status, whole) = post(&base, "/v1/chat/completions", chat.clone()).await;
        assert_eq!(status, 200, "{whole}");
        let content = whole["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 6);
        for t in content {
            assert_eq!(t["bytes"].as_array().unwrap().len(), t["token"].as_str().unwrap().len());
            assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
        }
        let mut streamed = chat;
        streamed["stream"] = json!(true);
        let events = stream(&base, "/v1/chat/completions", streamed).await;
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let per_chunk: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].get(0)).collect();
        assert_eq!(per_chunk.len(), 6);
        assert!(per_chunk.iter().zip(content).all(|(g, w)| g["token"] == w["token"] && close(&g["logprob"], w["logprob"].as_f64().unwrap() as f32)));
        // Without asking: none.
        let (_, plain) = post(&base, "/v1/completions", json!({"model": "tiny-ouro", "prompt": "x", "max_tokens": 2})).await;
        assert!(plain["choices"][0]["logprobs"].is_null());

        let sdar = serve("tiny-sdar", 0.0).await;
        let (status, r) = post(&sdar, "/v1/completions", json!({"model": "tiny-sdar", "prompt": "x", "max_tokens": 4, "logprobs": 1})).await;
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some("logprobs")), "{r}");
    })
    .await
}
