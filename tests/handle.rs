//! The engine on its own thread, streaming to callers on many threads.

mod common;
use common::*;
use ponder::{Event, FinishReason, GenerationParams, KvLayoutKind};

#[test]
fn many_threads_stream_the_same_tokens_as_sequential() {
    let (_tmp, dir) = tiny_dir(31);
    let ps = prompts(8, 2);
    let mut solo = builder(&dir, KvLayoutKind::DepthIndexed, 1).build().unwrap();
    let want = sequential(&mut solo, &ps, &vec![9; ps.len()]);

    let handle = builder(&dir, KvLayoutKind::DepthIndexed, 4).spawn().unwrap();
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let joins: Vec<_> = ps
            .iter()
            .map(|p| {
                let h = &handle;
                s.spawn(move || {
                    let stream = h.submit(p.clone(), GenerationParams::greedy(9)).unwrap();
                    let out = stream.collect_output();
                    assert_eq!(out.finish_reason, FinishReason::Length);
                    out.token_ids
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(got, want);

    // Errors come back to the submitting thread; abort ends a stream early.
    assert!(handle.submit(Vec::<u32>::new(), GenerationParams::greedy(4)).is_err());
    let mut stream = handle.submit(vec![1, 2, 3], GenerationParams::greedy(400)).unwrap();
    let first = stream.next().unwrap();
    assert!(matches!(first, Event::Token { .. }));
    handle.abort(stream.id).unwrap();
    let last = stream.last().unwrap();
    assert!(matches!(last, Event::Finished { reason: FinishReason::Aborted, .. }));
}

#[test]
fn dropping_a_stream_aborts_its_request() {
    let (_tmp, dir) = tiny_dir(32);
    let handle = builder(&dir, KvLayoutKind::Shared, 2).spawn().unwrap();
    let stream = handle.submit(vec![4, 5], GenerationParams::greedy(300)).unwrap();
    drop(stream);
    // The engine keeps serving others.
    let out = handle.submit(vec![6, 7], GenerationParams::greedy(5)).unwrap().collect_output();
    assert_eq!(out.token_ids.len(), 5);
}

#[test]
fn overlapped_engine_thread_streams_the_same_tokens() {
    use ponder::looped::gate::{DepthTrace, Lookahead, QExit, Replay};
    use ponder::SchedulerKind;
    let (_tmp, dir) = tiny_dir(33);
    let ps = prompts(6, 4);
    for lookahead in [false, true] {
        let make = |overlap: bool| {
            let b = builder(&dir, KvLayoutKind::Shared, 3).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).overlap(overlap));
            if lookahead {
                b.looped(|o| o.exit_gate(Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap()))
            } else {
                b.looped(|o| o.exit_gate(Replay::new(DepthTrace::with_mean(2.5, 2, 4, 1).unwrap(), 2, 4).unwrap()))
            }
        };
        let want = sequential(&mut make(false).build().unwrap(), &ps, &vec![7; ps.len()]);
        let handle = make(true).spawn().unwrap();
        let streams: Vec<_> = ps.iter().map(|p| handle.submit(p.clone(), GenerationParams::greedy(7)).unwrap()).collect();
        let got: Vec<Vec<u32>> = streams.into_iter().map(|s| s.collect_output().token_ids).collect();
        assert_eq!(got, want, "lookahead={lookahead}");
    }
    // A gate that needs each step's own signal cannot overlap: a typed error at build time.
    let q = ponder::looped::gate::QExit::new(0.5, 1, 4).unwrap();
    let err = builder(&dir, KvLayoutKind::Shared, 2).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(q).overlap(true)).build();
    assert!(matches!(err, Err(ponder::Error::InvalidOption(_))));
}

#[test]
fn outputs_carry_the_prompt_length_even_with_nothing_to_generate() {
    let (_tmp, dir) = tiny_dir(33);
    let mut engine = builder(&dir, KvLayoutKind::DepthIndexed, 2).build().unwrap();
    for n in [0, 3] {
        let out = engine.generate([vec![4u32, 5, 6, 7]], &GenerationParams::greedy(n)).unwrap().remove(0).unwrap();
        assert_eq!((out.prompt_tokens, out.token_ids.len()), (4, n));
    }
    let handle = builder(&dir, KvLayoutKind::DepthIndexed, 2).spawn().unwrap();
    for n in [0, 3] {
        let out = handle.submit(vec![4u32, 5, 6], GenerationParams::greedy(n)).unwrap().collect_output();
        assert_eq!((out.prompt_tokens, out.token_ids.len()), (3, n));
    }
}

#[test]
fn a_stalled_scheduler_ends_the_streams_with_an_error() {
    let (_tmp, dir) = tiny_dir(34);
    let handle = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.custom_scheduler(|_| Box::new(Stuck))).spawn().unwrap();
    let out = handle.submit(vec![1u32, 2], GenerationParams::greedy(4)).unwrap().collect_output();
    assert!(matches!(out.finish_reason, FinishReason::Error(ref m) if m.contains("stuck")), "{:?}", out.finish_reason);
    // The engine thread is idle again and serves the next request the same way.
    let again = handle.submit(vec![3u32], GenerationParams::greedy(2)).unwrap().collect_output();
    assert!(matches!(again.finish_reason, FinishReason::Error(_)));
}

/// A text or chat prompt is encoded on the thread that submits it: while a slow chat template
/// renders there, the engine thread goes on answering (here a metrics request, which waits for
/// the engine thread's next turn) instead of holding every other request up for the rendering.
#[test]
fn a_slow_chat_template_renders_on_the_submitting_thread() {
    use ponder::{Chat, ChatMessage, ChatTemplate, EngineBuilder, Prompt};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    // Comparing two deeply nested lists is one template instruction that takes long (as in
    // `chat.rs`'s time-limit test), then the messages as the prompt.
    let (open, close) = ("[".repeat(25), "]".repeat(25));
    let nest = |v: &str| format!("{{% set ns.{v} = {open}ns.{v}{close} %}}");
    let src = format!(
        "{{% set ns = namespace(x=1, y=1) %}}{{% for i in range(50) %}}{{% for j in range(40) %}}{}{}{{% endfor %}}{{% endfor %}}{{% for i in range(40) %}}{{{{ ns.x == ns.y }}}}{{% endfor %}}{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}",
        nest("x"),
        nest("y")
    );
    let slow = ChatTemplate::new(src, None, None).unwrap();
    let chat = Chat::new(vec![ChatMessage::new("user", "Ownership in Rust")]);
    let started = Instant::now();
    slow.render(&chat).unwrap();
    let render = started.elapsed();
    assert!(render >= Duration::from_millis(100), "the template renders in {render:?}: too fast to tell the threads apart");

    let handle = EngineBuilder::new(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro")).chat_template(slow).spawn().unwrap();
    let submitted = AtomicBool::new(false);
    std::thread::scope(|s| {
        let submitter = s.spawn(|| {
            let out = handle.submit(Prompt::Chat(chat.clone()), GenerationParams::greedy(2)).map(|s| s.collect_output());
            submitted.store(true, Ordering::SeqCst);
            out
        });
        std::thread::sleep(render / 4);
        let asked = Instant::now();
        handle.metrics().unwrap();
        let answered = asked.elapsed();
        assert!(!submitted.load(Ordering::SeqCst), "the submission ended before the engine answered");
        assert!(answered < render / 2, "the engine thread answered after {answered:?} of a {render:?} rendering");
        let out = submitter.join().unwrap().unwrap();
        assert_eq!(out.token_ids.len(), 2);
    });
}
