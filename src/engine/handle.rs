//! The engine on its own thread, fed and drained through channels.

use super::{Engine, EngineMetrics, Event, FinishReason, GenerationParams, ModelInfo, Output, Prompt, RequestId};
use crate::chat::ChatTemplate;
use crate::{Error, Result};
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use std::collections::HashMap;
use std::thread::JoinHandle;

/// A request handed to the engine thread (boxed: a chat prompt makes it large).
struct Submit {
    prompt: Prompt,
    params: GenerationParams,
    reply: Sender<Result<(RequestId, usize)>>,
    events: Sender<Event>,
}

enum Command {
    Submit(Box<Submit>),
    Abort(RequestId),
    Metrics(Sender<EngineMetrics>),
    Shutdown,
}

/// A cloneable-by-reference handle to an engine thread. `submit` may be called from many
/// threads at once; each request streams its events on its own channel. A text or chat prompt
/// is encoded on the calling thread, so the engine thread only ever steps. Dropping the handle
/// stops the thread after aborting what is still running.
pub struct EngineHandle {
    tx: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    tokenizer: Option<tokenizers::Tokenizer>,
    chat: Option<ChatTemplate>,
    model: ModelInfo,
}

/// The events of one request, in order, ending with `Finished`.
pub struct RequestStream {
    pub id: RequestId,
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    rx: Receiver<Event>,
}

impl Iterator for RequestStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.rx.recv().ok()
    }
}

impl RequestStream {
    /// Drains the stream into an [`Output`].
    pub fn collect_output(self) -> Output {
        let mut out = Output::new(self.id, self.prompt_tokens);
        for ev in self {
            out.push(ev);
        }
        out
    }
}

impl EngineHandle {
    pub(super) fn spawn(build: impl FnOnce() -> Result<Engine> + Send + 'static) -> Result<Self> {
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let thread = std::thread::Builder::new()
            .name("ponder-engine".into())
            .spawn(move || match build() {
                Ok(engine) => {
                    let _ = ready_tx.send(Ok((engine.tokenizer().cloned(), engine.chat_template().cloned(), engine.model_info())));
                    serve(engine, rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| Error::InvalidOption(format!("cannot start engine thread: {e}")))?;
        let (tokenizer, chat, model) = ready_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(Self { tx, thread: Some(thread), tokenizer, chat, model })
    }

    /// What the engine serves: the model's spec, vocabulary and accepted context.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    /// The model's tokenizer (a copy; `None` for a model served on token ids).
    pub fn tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Queues a request; its events arrive on the returned stream. A text or chat prompt is
    /// encoded here, on the caller's thread (a text the tokenizer or the template refuses is
    /// that error, and no request); the engine thread checks and admits the ids.
    pub fn submit(&self, prompt: impl Into<Prompt>, params: GenerationParams) -> Result<RequestStream> {
        let ids = super::core::prompt_ids(self.tokenizer.as_ref(), self.chat.as_ref(), prompt.into())?;
        let (reply, reply_rx) = bounded(1);
        let (events, rx) = unbounded();
        self.tx.send(Command::Submit(Box::new(Submit { prompt: Prompt::Ids(ids), params, reply, events }))).map_err(|_| Error::EngineStopped)?;
        let (id, prompt_tokens) = reply_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(RequestStream { id, prompt_tokens, rx })
    }

    /// A snapshot of the engine's metrics, taken between two steps.
    pub fn metrics(&self) -> Result<EngineMetrics> {
        let (reply, rx) = bounded(1);
        self.tx.send(Command::Metrics(reply)).map_err(|_| Error::EngineStopped)?;
        rx.recv().map_err(|_| Error::EngineStopped)
    }

    /// Aborts a request; its stream ends with `Finished { Aborted }`.
    pub fn abort(&self, id: RequestId) -> Result<()> {
        self.tx.send(Command::Abort(id)).map_err(|_| Error::EngineStopped)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine thread: commands in, steps, events out. A panic inside the engine (a plug-in's
/// scheduler or gate, a bug of ours) ends every open stream with `Finished { Error }` naming
/// it, rather than a silent end a reader would take for an abort; the thread then stops, and
/// later calls get `EngineStopped`.
fn serve(engine: Engine, rx: Receiver<Command>) {
    let mut streams: HashMap<RequestId, Sender<Event>> = HashMap::new();
    let mut engine = std::panic::AssertUnwindSafe(engine);
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_loop(&mut engine, &rx, &mut streams)));
    if let Err(panic) = run {
        let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
        let reason = FinishReason::Error(format!("the engine thread panicked: {what}"));
        for (id, stream) in streams.drain() {
            let _ = stream.send(Event::Finished { id, reason: reason.clone(), text: String::new() });
        }
        // The engine's state is whatever the panic left; freeing it may panic again.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(engine)));
    }
}

fn serve_loop(engine: &mut Engine, rx: &Receiver<Command>, streams: &mut HashMap<RequestId, Sender<Event>>) {
    loop {
        // Block for commands only when idle; otherwise take what is queued and keep stepping.
        let first = if engine.has_work() { rx.try_recv().ok() } else { rx.recv().ok().or(Some(Command::Shutdown)) };
        let mut shutdown = false;
        for cmd in first.into_iter().chain(rx.try_iter()) {
            match cmd {
                Command::Submit(submit) => {
                    let Submit { prompt, params, reply, events } = *submit;
                    let r = engine.admit(prompt, params);
                    if let Ok((id, _)) = &r {
                        streams.insert(*id, events);
                    }
                    let _ = reply.send(r);
                }
                Command::Abort(id) => {
                    let _ = engine.abort(id);
                }
                Command::Metrics(reply) => {
                    let _ = reply.send(engine.metrics().clone());
                }
                Command::Shutdown => shutdown = true,
            }
        }
        if shutdown {
            for id in streams.keys().copied().collect::<Vec<_>>() {
                let _ = engine.abort(id);
            }
        }
        let events = engine.step().unwrap_or_else(|_| engine.step().unwrap_or_default());
        for ev in events {
            let id = ev.id();
            let done = matches!(ev, Event::Finished { .. });
            let delivered = streams.get(&id).is_some_and(|s| s.send(ev).is_ok());
            if done {
                streams.remove(&id);
            } else if !delivered {
                // The caller dropped its stream: stop computing for it.
                streams.remove(&id);
                let _ = engine.abort(id);
            }
        }
        if shutdown {
            return;
        }
    }
}
