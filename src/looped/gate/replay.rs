//! Replayed exit depths: per (request, token) depths from a recorded trace or from a seeded
//! generator with a given depth distribution. The CDB authors drive their throughput runs this
//! way; a replayed depth is exact whatever the batch, so runs are comparable across modes.

use super::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};
use crate::dist::{draw, mix};
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// Where replayed depths come from.
#[derive(Debug, Clone, PartialEq)]
pub enum DepthTrace {
    /// Recorded depths: request id → depth of each generated token (tokens past the end of a
    /// list take its last value).
    Recorded(HashMap<u64, Vec<usize>>),
    /// `probs[i]` = P(depth = i + 1); a depth per (seed, request, token) by hashing.
    Seeded { probs: Vec<f64>, seed: u64 },
    /// Recorded depths laid end to end, replayed on any workload: token t of request r reads
    /// `depths[(offset(r) + t) % len]` with a seeded offset per request, so each request replays
    /// a contiguous stretch of what a gate chose on real text.
    Stream { depths: Vec<usize>, seed: u64 },
}

impl DepthTrace {
    /// Reads `{"depths": {"<request id>": [d, ...], ...}}`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        #[derive(serde::Deserialize)]
        struct File {
            depths: HashMap<String, Vec<usize>>,
        }
        let bad = |r: String| Error::config(path.display().to_string(), r);
        let f: File = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut out = HashMap::new();
        for (k, v) in f.depths {
            let id = k.parse::<u64>().map_err(|_| bad(format!("request id `{k}` is not an integer")))?;
            if v.is_empty() || v.contains(&0) {
                return Err(bad(format!("request {k}: depths must be non-empty and >= 1")));
            }
            out.insert(id, v);
        }
        Ok(Self::Recorded(out))
    }

    /// A recorded file (as [`DepthTrace::from_json_file`]) as a [`DepthTrace::Stream`]: each
    /// request's depths after its first token (which the prefill ran), in request-id order.
    pub fn stream_from_json_file(path: &Path, seed: u64) -> Result<Self> {
        let Self::Recorded(m) = Self::from_json_file(path)? else { unreachable!("a file is recorded") };
        let mut ids: Vec<u64> = m.keys().copied().collect();
        ids.sort_unstable();
        let depths: Vec<usize> = ids.iter().flat_map(|id| m[id].iter().skip(1).copied()).collect();
        if depths.is_empty() {
            return Err(Error::config(path.display().to_string(), "no depths after the first token of any request"));
        }
        Ok(Self::Stream { depths, seed })
    }

    /// Depths in `min..=max` with mean `mean`: an exponentially tilted distribution (p_d ∝ e^{θd})
    /// whose θ is solved so the mean is exact, so depths spread over the whole range.
    pub fn with_mean(mean: f64, min: usize, max: usize, seed: u64) -> Result<Self> {
        if min == 0 || min > max || !(mean >= min as f64 && mean <= max as f64) {
            return Err(Error::InvalidOption(format!("depth mean {mean} outside {min}..={max}")));
        }
        Ok(Self::Seeded { probs: crate::dist::tilted(min, max, mean), seed })
    }

    /// Mean depth the trace implies (seeded: exact expectation).
    pub fn expected_mean(&self) -> f64 {
        match self {
            Self::Seeded { probs, .. } => crate::dist::mean_of(probs),
            Self::Recorded(m) => {
                let all: Vec<usize> = m.values().flatten().copied().collect();
                all.iter().sum::<usize>() as f64 / all.len().max(1) as f64
            }
            Self::Stream { depths, .. } => depths.iter().sum::<usize>() as f64 / depths.len().max(1) as f64,
        }
    }

    pub fn depth(&self, item: ItemRef) -> Option<usize> {
        match self {
            // Past the end of a request's list its last depth repeats; an empty list covers nothing.
            Self::Recorded(m) => m.get(&item.request.0).and_then(|v| v.get(item.token_index).or(v.last()).copied()),
            Self::Seeded { probs, seed } => Some(draw(probs, mix(*seed ^ mix(item.request.0 ^ mix(item.token_index as u64))))),
            Self::Stream { depths, seed } => {
                let offset = mix(*seed ^ mix(item.request.0)) as usize;
                depths.get(offset.wrapping_add(item.token_index) % depths.len().max(1)).copied()
            }
        }
    }
}

/// Exits each item at its replayed depth (clamped to `min_steps..=max_steps`; items the trace
/// does not cover run `max_steps`). It stands in for a live gate: the model still computes the
/// gate logit and copies it back, as the gate it replays would.
#[derive(Debug, Clone)]
pub struct Replay {
    trace: DepthTrace,
    bounds: StepBounds,
}

impl Replay {
    pub fn new(trace: DepthTrace, min_steps: usize, max_steps: usize) -> Result<Self> {
        Ok(Self { trace, bounds: StepBounds::new(min_steps, max_steps)? })
    }
    pub fn trace(&self) -> &DepthTrace {
        &self.trace
    }
}

impl ExitGate for Replay {
    fn name(&self) -> String {
        format!("replay(mean {:.2})", self.trace.expected_mean())
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, item: ItemRef, step: usize, _signal: StepSignals, state: &mut GateState) -> bool {
        self.exit_known(item, step, state).expect("always known")
    }
    fn exit_known(&self, item: ItemRef, step: usize, _state: &GateState) -> Option<bool> {
        let depth = self.bounds.clamp(self.trace.depth(item).unwrap_or(self.bounds.max()));
        Some(step + 1 >= depth)
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestId;

    #[test]
    fn seeded_depths_hit_the_mean() {
        let t = DepthTrace::with_mean(2.5, 1, 4, 3).unwrap();
        assert!((t.expected_mean() - 2.5).abs() < 1e-6);
        let n = 20_000;
        let sum: usize = (0..n).map(|i| t.depth(ItemRef { request: RequestId(i / 100), token_index: (i % 100) as usize, input_token: None }).unwrap()).sum();
        assert!((sum as f64 / n as f64 - 2.5).abs() < 0.05);
        let t16 = DepthTrace::with_mean(6.0, 2, 16, 1).unwrap();
        assert!((t16.expected_mean() - 6.0).abs() < 1e-6);
        assert!(DepthTrace::with_mean(5.0, 1, 4, 0).is_err());
    }

    #[test]
    fn recorded_trace_and_clamping() {
        let mut m = HashMap::new();
        m.insert(7, vec![1, 3, 9]);
        let g = Replay::new(DepthTrace::Recorded(m), 2, 4).unwrap();
        let depth = |tok| {
            let mut s = GateState::new();
            (0..4).find(|&r| g.decide(ItemRef { request: RequestId(7), token_index: tok, input_token: None }, r, StepSignals::default(), &mut s)).unwrap() + 1
        };
        assert_eq!((depth(0), depth(1), depth(2), depth(5)), (2, 3, 4, 4));
    }

    #[test]
    fn a_stream_replays_contiguous_stretches_of_the_recording() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("trace.json");
        std::fs::write(&path, r#"{"depths": {"1": [4, 2, 3], "0": [4, 1, 2]}}"#).unwrap();
        let t = DepthTrace::stream_from_json_file(&path, 5).unwrap();
        assert_eq!(t, DepthTrace::Stream { depths: vec![1, 2, 2, 3], seed: 5 }, "first tokens skipped, requests in id order");
        assert!((t.expected_mean() - 2.0).abs() < 1e-12);
        let at = |r: u64, k: usize| t.depth(ItemRef { request: RequestId(r), token_index: k, input_token: None }).unwrap();
        for r in 0..20 {
            let start = (0..4).find(|&o| (0..4).all(|k| at(r, k) == [1, 2, 2, 3][(o + k) % 4])).is_some();
            assert!(start, "request {r} reads the stream in order");
        }
        std::fs::write(&path, r#"{"depths": {"0": [4]}}"#).unwrap();
        assert!(DepthTrace::stream_from_json_file(&path, 5).is_err());
    }
}
