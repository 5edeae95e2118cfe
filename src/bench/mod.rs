//! Benchmark harness for looped models, the one `examples/bench_looped` runs on: a synthetic
//! workload ([`workload`]) and an offline run measured over its steady-state window
//! ([`offline`]); [`device_memory`] reads the peak device memory a run used. Any engine goes in — a custom scheduler, exit gate or KV layout is measured on
//! the same requests and by the same rules as the built-in modes:
//!
//! ```no_run
//! use ponder::bench::{offline, workload, Lengths, Window};
//! # fn main() -> ponder::Result<()> {
//! let mut engine = ponder::EngineBuilder::new("assets/tiny-ouro").max_num_seqs(8).build()?;
//! let jobs = workload(32, 4096, 2048, 1, Lengths::default());
//! let run = offline(&mut engine, &jobs, Window { open_after: 8, completions: Some(8), drain: false })?;
//! println!("{:.0} tokens/s at mean depth {:.2}", run.window_tokens_per_s, run.mean_depth);
//! # Ok(())
//! # }
//! ```

pub mod device_memory;
pub mod device_peak;
mod offline;
mod workload;

pub use offline::{offline, stage_device, RunStats, Window};
pub use workload::{random_ids, workload, Job, Lengths};

use crate::{Error, Event, FinishReason, Output, Result};

/// The GPU this machine reports (`nvidia-smi`'s first card), or `cpu`: what a benchmark's JSON
/// records as its device.
pub fn gpu_name() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "cpu".into())
}

/// A benchmark's figures mean something only over the work it asked for: a request that ended
/// with an error stops the run with that error ([`Error::RequestFailed`]).
pub fn fail_on_error(event: &Event) -> Result<()> {
    match event {
        Event::Finished { id, reason: FinishReason::Error(why), .. } => Err(Error::RequestFailed { id: *id, reason: why.clone() }),
        _ => Ok(()),
    }
}

/// The outputs of [`crate::Engine::generate`] when every request was served in full
/// (`new_tokens` tokens each, eos ignored); else the first request that was not, as
/// [`Error::RequestFailed`] with its finish reason.
pub fn served_in_full(outputs: Vec<Result<Output>>, new_tokens: usize) -> Result<Vec<Output>> {
    outputs
        .into_iter()
        .map(|o| {
            let o = o?;
            if o.token_ids.len() == new_tokens {
                return Ok(o);
            }
            let reason = match &o.finish_reason {
                FinishReason::Error(why) => why.clone(),
                other => format!("ended ({other:?}) after {} of {new_tokens} tokens", o.token_ids.len()),
            };
            Err(Error::RequestFailed { id: o.id, reason })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestId;

    #[test]
    fn a_failed_or_short_request_stops_a_benchmark() {
        let finished = |reason| Event::Finished { id: RequestId(3), reason, text: String::new() };
        assert!(fail_on_error(&finished(FinishReason::Length)).is_ok());
        let err = fail_on_error(&finished(FinishReason::Error("out of memory".into()))).unwrap_err();
        assert!(matches!(&err, Error::RequestFailed { id: RequestId(3), reason } if reason == "out of memory"), "{err:?}");

        let out = |tokens: usize, reason| {
            let mut o = Output::new(RequestId(tokens as u64), 5);
            o.token_ids = vec![1; tokens];
            o.finish_reason = reason;
            Ok(o)
        };
        assert_eq!(served_in_full(vec![out(4, FinishReason::Length), out(4, FinishReason::Length)], 4).unwrap().len(), 2);
        let err = served_in_full(vec![out(4, FinishReason::Length), out(0, FinishReason::Error("no memory".into()))], 4).unwrap_err();
        assert!(matches!(&err, Error::RequestFailed { reason, .. } if reason == "no memory"), "{err:?}");
        let err = served_in_full(vec![out(2, FinishReason::Eos)], 4).unwrap_err();
        assert!(err.to_string().contains("after 2 of 4 tokens"), "{err}");
        assert!(served_in_full(vec![Err(Error::EngineStopped)], 4).is_err(), "a rejected request stops it too");
    }
}
