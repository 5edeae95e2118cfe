//! What runs a looped engine's launches: one [`LoopedRunner`], or one per tensor-parallel rank.
//!
//! Ranks get the same launch and the same sampling rows. Their models end every layer with an
//! all-reduce that leaves bit-identical hidden states on every rank, so their logits, sampled
//! tokens, re-entered states and gate signals agree; rank 0's result is the launch's, and a
//! rank that answers differently is an error, never a silent pick.

use super::launch::{LoopedLaunch, LoopedResult};
use super::metrics::GraphStats;
use super::models::LoopedSpec;
use super::runner::{LoopedRunner, Pending};
use crate::engine::DeviceSpan;
use crate::ops::KernelCounts;
use crate::parallel::{RankJob, Ranks, RanksPending};
use crate::sampling::RowSampling;
use crate::Result;
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) enum LoopedExecutor {
    One(LoopedRunner),
    Ranks(RankedRunners),
}

/// An issued launch.
pub(crate) enum ExecutorPending {
    One(Box<Pending>),
    /// Launch `id`, issued on every rank (each keeps its own pending results until collected).
    Ranks {
        id: u64,
        issued: RanksPending<KernelCounts>,
    },
}

/// A tensor-parallel group's runners, each on its rank's thread.
pub(crate) struct RankedRunners {
    ranks: Ranks<RankRunner>,
    /// Rank 0's spec (every rank's but for its share of the heads).
    spec: LoopedSpec,
    last_device: Option<DeviceSpan>,
    graph_stats: GraphStats,
    next_launch: u64,
}

/// One rank's runner and the launches it has issued but not yet collected: a launch and its
/// collection are separate jobs, so that under overlap a rank queues launch N + 1's kernels
/// before it waits for launch N's results, as one runner does.
pub(crate) struct RankRunner {
    runner: LoopedRunner,
    issued: HashMap<u64, Pending>,
}

/// What a rank reports of one collected launch.
pub(crate) struct RankOutcome {
    result: LoopedResult,
    /// What collecting dispatched (the engine's policy in force on the rank's thread).
    kernels: KernelCounts,
    device: Option<DeviceSpan>,
    graph_stats: GraphStats,
}

impl RankedRunners {
    pub(crate) fn new(runners: Vec<LoopedRunner>, comms: Vec<Arc<dyn crate::parallel::Communicator>>, timeout: std::time::Duration) -> Result<Self> {
        let spec = runners.first().map(|r| r.model().spec().clone()).ok_or_else(|| crate::Error::InvalidOption("no ranks".into()))?;
        // Tensors the builder made on this thread are ready before another thread uses them.
        for r in &runners {
            r.model().device().synchronize()?;
        }
        // Before the group is rebuilt after a failure: captured graphs hold collectives on the
        // old communicators (and an aborted NCCL group is freed only once they are gone), and
        // the device's queue is drained of what the failed launch left.
        let on_reset: crate::parallel::OnReset<RankRunner> = Arc::new(|rank: &mut RankRunner| {
            rank.runner.forget_graphs();
            let _ = rank.runner.model().device().synchronize();
        });
        let runners = runners.into_iter().map(|runner| RankRunner { runner, issued: HashMap::new() }).collect();
        let ranks = Ranks::spawn(runners, comms, timeout, Some(on_reset))?;
        Ok(Self { ranks, spec, last_device: None, graph_stats: GraphStats::default(), next_launch: 0 })
    }

    /// Drops launch `id`'s pending results on every rank that holds them (a launch that failed
    /// somewhere). Nothing waits for it: later jobs queue behind it.
    fn discard(&mut self, id: u64) {
        let job: RankJob<RankRunner, ()> = Arc::new(move |_, rank: &mut RankRunner| {
            rank.issued.remove(&id);
            Ok(())
        });
        drop(self.ranks.run(job));
    }
}

impl LoopedExecutor {
    pub(crate) fn spec(&self) -> &LoopedSpec {
        match self {
            Self::One(r) => r.model().spec(),
            Self::Ranks(r) => &r.spec,
        }
    }

    pub(crate) fn launch(&mut self, launch: &LoopedLaunch, sampling: &[RowSampling]) -> Result<ExecutorPending> {
        match self {
            Self::One(r) => Ok(ExecutorPending::One(Box::new(r.launch(launch, sampling)?))),
            Self::Ranks(r) => {
                let (launch, sampling) = (Arc::new(launch.clone()), Arc::new(sampling.to_vec()));
                let id = r.next_launch;
                r.next_launch += 1;
                // The engine's kernel policy, in force on this (the engine's) thread: each rank
                // runs under it too.
                let policy = crate::ops::policy::current();
                let job: RankJob<RankRunner, KernelCounts> = Arc::new(move |_, rank: &mut RankRunner| {
                    let (pending, kernels) = crate::ops::with_kernels(policy, || rank.runner.launch(&launch, &sampling));
                    rank.issued.insert(id, pending?);
                    Ok(kernels)
                });
                Ok(ExecutorPending::Ranks { id, issued: r.ranks.run(job) })
            }
        }
    }

    pub(crate) fn collect(&mut self, pending: ExecutorPending) -> Result<LoopedResult> {
        match (self, pending) {
            (Self::One(r), ExecutorPending::One(p)) => Ok(r.collect(*p)?),
            (Self::Ranks(r), ExecutorPending::Ranks { id, issued }) => {
                let kernels = match r.ranks.wait(issued) {
                    Ok(k) => k,
                    Err(e) => {
                        r.discard(id);
                        return Err(e);
                    }
                };
                // Rank 0's dispatches count as the launch's (every rank's are the same).
                crate::ops::policy::count(|c| *c += kernels[0]);
                let policy = crate::ops::policy::current();
                let job: RankJob<RankRunner, RankOutcome> = Arc::new(move |_, rank: &mut RankRunner| {
                    let pending = rank.issued.remove(&id).ok_or_else(|| crate::Error::InvalidOption(format!("launch {id} was not issued on this rank")))?;
                    let (result, kernels) = crate::ops::with_kernels(policy, || rank.runner.collect(pending));
                    let runner = &rank.runner;
                    Ok(RankOutcome { result: result?, kernels, device: runner.last_device_time(), graph_stats: runner.graph_stats() })
                });
                let pending = r.ranks.run(job);
                let mut outcomes = r.ranks.wait(pending)?;
                if let Some(rank) = outcomes.iter().position(|o| !same_answer(&o.result, &outcomes[0].result)) {
                    return Err(disagree(rank, outcomes.len()));
                }
                let first = outcomes.swap_remove(0);
                crate::ops::policy::count(|c| *c += first.kernels);
                r.last_device = first.device;
                r.graph_stats = first.graph_stats;
                Ok(first.result)
            }
            _ => Err(crate::Error::InvalidOption("a launch collected by an executor that did not issue it".into())),
        }
    }

    /// Device-side span of the last collected launch (rank 0's).
    pub(crate) fn last_device_time(&self) -> Option<DeviceSpan> {
        match self {
            Self::One(r) => r.last_device_time(),
            Self::Ranks(r) => r.last_device,
        }
    }

    /// Graphs captured, launches replayed and the graphs' nodes so far (rank 0's).
    pub(crate) fn graph_stats(&self) -> GraphStats {
        match self {
            Self::One(r) => r.graph_stats(),
            Self::Ranks(r) => r.graph_stats,
        }
    }
}

/// Whether two ranks answered a launch alike: the same tokens, log-probabilities and gate
/// signals (compared by their bits, so a non-finite one compares equal to itself).
fn same_answer(a: &LoopedResult, b: &LoopedResult) -> bool {
    let bits = |g: &[f32]| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let logprob = |r: &super::launch::LoopedRowOutput| {
        r.logprob.as_ref().map(|l| (l.logprob.to_bits(), l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect::<Vec<_>>()))
    };
    a.non_finite == b.non_finite
        && a.rows.len() == b.rows.len()
        && a.rows.iter().zip(&b.rows).all(|(x, y)| {
            x.request == y.request
                && x.token == y.token
                && bits(&x.gate_logits) == bits(&y.gate_logits)
                && x.latent_diff.map(f32::to_bits) == y.latent_diff.map(f32::to_bits)
                && logprob(x) == logprob(y)
        })
}

fn disagree(rank: usize, world: usize) -> crate::Error {
    crate::Error::Collective {
        collective: "launch",
        rank,
        world,
        reason: format!("ranks 0 and {rank} disagree on a launch's tokens, log-probabilities or gate signals"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvManager;
    use crate::loader::Weights;
    use crate::looped::models::{LoopedModel, Ouro};
    use crate::looped::{LoopedRow, Stage};
    use crate::parallel::{Communicator, LocalGroup, TpRank};
    use crate::RequestId;
    use candle_core::{DType, Device, Tensor};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// A rank whose `fail_at`-th all-reduce fails (a device fault in the middle of a launch).
    struct Faulty {
        inner: crate::parallel::LocalComm,
        fail_at: usize,
        calls: AtomicUsize,
    }

    impl Communicator for Faulty {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn all_reduce_sum(&self, t: &Tensor) -> crate::Result<Tensor> {
            if self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
                return Err(crate::Error::InvalidOption("injected fault".into()));
            }
            self.inner.all_reduce_sum(t)
        }
        fn all_gather(&self, t: &Tensor, dim: usize) -> crate::Result<Tensor> {
            self.inner.all_gather(t, dim)
        }
        fn all_to_all(&self, parts: Vec<Tensor>) -> crate::Result<Vec<Tensor>> {
            self.inner.all_to_all(parts)
        }
        fn abort(&self, reason: &str) -> bool {
            self.inner.abort(reason)
        }
        fn is_aborted(&self) -> bool {
            self.inner.is_aborted()
        }
        fn reset(&self) {
            self.inner.reset()
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(30);

    /// A tiny Ouro over two ranks whose rank 1 fails its `fail_at`-th all-reduce, and a prefill
    /// launch of `prompt`.
    fn faulty_pair(fail_at: usize, seed: u64, prompt: Vec<u32>) -> (LoopedExecutor, LoopedLaunch, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = crate::testing::tiny_ouro_config(97);
        crate::testing::write_random_ouro(tmp.path(), &cfg, seed).unwrap();
        let weights = Weights::from_files(&[tmp.path().join("model.safetensors")], DType::F32, &Device::Cpu).unwrap();
        let comms: Vec<Arc<dyn Communicator>> = LocalGroup::new(2, TIMEOUT)
            .unwrap()
            .into_iter()
            .map(|c| {
                let fail_at = if c.rank() == 1 { fail_at } else { 0 };
                Arc::new(Faulty { inner: c, fail_at, calls: AtomicUsize::new(0) }) as Arc<dyn Communicator>
            })
            .collect();
        let (blocks, block) = (64, 4);
        let runners: Vec<LoopedRunner> = comms
            .iter()
            .map(|c| {
                let model: Box<dyn LoopedModel> = Box::new(Ouro::load_shard(&cfg, &weights, TpRank::new(c.rank(), 2).unwrap(), c.clone()).unwrap());
                LoopedRunner::new(model, blocks, block, 0).unwrap()
            })
            .collect();
        let exec = LoopedExecutor::Ranks(RankedRunners::new(runners, comms, TIMEOUT).unwrap());
        let mut kv = KvManager::new(blocks, block, cfg.total_ut_steps);
        assert!(kv.reserve(RequestId(0), 8));
        let launch = LoopedLaunch {
            stage: Stage::Prefill,
            step_slots: (0..cfg.total_ut_steps).collect(),
            rows: vec![LoopedRow::full_depth(RequestId(0), prompt, 0, kv.tables(RequestId(0)).unwrap().to_vec())],
            kv_copies: vec![],
            reenter: false,
        };
        (exec, launch, tmp)
    }

    #[test]
    fn a_rank_failing_mid_launch_fails_the_launch_on_time_and_the_next_one_runs() {
        // Rank 1's third all-reduce fails: rank 0 is then waiting in that collective.
        let (mut exec, launch, _tmp) = faulty_pair(3, 5, vec![3, 1, 4, 1, 5]);
        let sampling = [RowSampling::greedy()];
        let started = Instant::now();
        let failed = exec.launch(&launch, &sampling).and_then(|p| exec.collect(p));
        assert!(matches!(&failed, Err(e) if e.to_string().contains("injected fault")), "the failing rank's own error: {failed:?}");
        assert!(started.elapsed() < TIMEOUT / 3, "the other rank stopped waiting at once");
        // The group is usable again: the same launch runs and both ranks agree.
        let again = exec.launch(&launch, &sampling).and_then(|p| exec.collect(p)).unwrap();
        assert!(again.rows[0].token.is_some());
    }

    /// Under overlap: a launch that fails with the next already issued; that one fails too
    /// (its group went down under it), the one issued after the failure was seen runs, and so
    /// does every later one.
    #[test]
    fn under_overlap_one_failure_fails_the_launches_in_flight_and_no_more() {
        let (mut exec, launch, _tmp) = faulty_pair(5, 6, vec![2, 7, 1, 8]);
        let sampling = [RowSampling::greedy()];
        let (a, b) = (exec.launch(&launch, &sampling).unwrap(), exec.launch(&launch, &sampling).unwrap());
        assert!(exec.collect(a).unwrap_err().to_string().contains("injected fault"));
        let c = exec.launch(&launch, &sampling).unwrap();
        assert!(exec.collect(b).is_err(), "issued before the failure was seen: its group was down");
        let good = exec.collect(c).unwrap();
        for _ in 0..3 {
            assert_eq!(exec.launch(&launch, &sampling).and_then(|p| exec.collect(p)).unwrap(), good);
        }
    }
}
