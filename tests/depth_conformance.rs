//! The conformance matrix of depth batching: for every scheduler {CB, depth-refill,
//! depth-no-refill} × layout {depth-indexed, last-exited, shared, first-then-shared} × gate
//! {fixed, q-exit, replay, lookahead(q-exit), learned lookahead, preloop} that is valid, batched greedy output equals each
//! request run alone (token-exact, f32, CPU) and the KV pool is empty afterwards.

mod common;
use common::*;
use ponder::{KvLayoutKind, SchedulerKind};
use std::collections::HashMap;

#[test]
fn every_valid_combination_is_batch_invariant() {
    let (_tmp, dir) = tiny_dir(41);
    let ps = prompts(7, 13);
    let max_new: Vec<usize> = (0..ps.len()).map(|i| 4 + (i * 3) % 9).collect();
    let combos = combos();
    assert!(combos.len() >= 25, "matrix has {} combinations", combos.len());
    let mut by_name = HashMap::new();
    let mut overlapped = 0;
    for c in &combos {
        let mut solo = combo_builder(&dir, c, 1).build().unwrap();
        let want = sequential(&mut solo, &ps, &max_new);
        assert_kv_empty(&solo);
        let mut engine = combo_builder(&dir, c, 3).build().unwrap();
        let got = batched(&mut engine, &ps, &max_new);
        for i in 0..ps.len() {
            assert_eq!(got[i], want[i], "{}: request {i}", c.name);
        }
        assert_kv_empty(&engine);
        // Overlapped launches (host schedules N+1 before N's results) give the same tokens.
        let mut ahead = combo_builder(&dir, c, 3).build().unwrap();
        if ahead.set_overlap(true).is_ok() {
            overlapped += 1;
            assert_eq!(batched(&mut ahead, &ps, &max_new), want, "{} with overlap", c.name);
            assert_kv_empty(&ahead);
        }
        if c.scheduler != SchedulerKind::Continuous && !c.name.contains("fixed4") {
            let d = engine.metrics().looped().unwrap().mean_depth();
            assert!(d > 1.0 && d < 4.0, "{}: gated exits realise a mean depth strictly inside (1, 4), got {d}", c.name);
        }
        by_name.insert(c.name.clone(), want);
    }
    assert!(overlapped >= 10, "{overlapped} combinations ran with overlap");
    // At full depth the depth schedulers compute exactly what CB computes.
    for layout in [KvLayoutKind::DepthIndexed, KvLayoutKind::Shared] {
        let cb = &by_name[&format!("Continuous × {layout:?} × fixed4")];
        for refill in [true, false] {
            let d = &by_name[&format!("{:?} × {layout:?} × fixed4", SchedulerKind::Depth { refill })];
            assert_eq!(d, cb, "depth(refill={refill}) at full depth == CB for {layout:?}");
        }
    }
}

#[test]
fn overlap_needs_a_gate_that_decides_ahead() {
    let (_tmp, dir) = tiny_dir(43);
    let q = ponder::looped::gate::QExit::new(0.5, 1, 4).unwrap();
    let mut e = builder(&dir, KvLayoutKind::Shared, 2).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(q)).build().unwrap();
    assert!(matches!(e.set_overlap(true), Err(ponder::Error::InvalidOption(_))));
    let mut cb = builder(&dir, KvLayoutKind::Shared, 2).build().unwrap();
    assert!(cb.set_overlap(true).is_err(), "CB needs each token before the next launch");
}

#[test]
fn invalid_layout_gate_combination_is_rejected() {
    let (_tmp, dir) = tiny_dir(42);
    let q = ponder::looped::gate::QExit::new(0.5, 1, 4).unwrap();
    let err = builder(&dir, KvLayoutKind::DepthIndexed, 2).looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).exit_gate(q)).build();
    assert!(matches!(err, Err(ponder::Error::InvalidOption(m)) if m.contains("depth-indexed")));
}
