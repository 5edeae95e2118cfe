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
