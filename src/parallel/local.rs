//! The in-process group: ranks are threads of one process that meet in shared memory. What the
//! CPU tests of tensor and expert parallelism run on, with the failure behaviour of the real
//! thing: a rank that gives up or does not arrive within the timeout ends every rank's
//! collective with an error instead of leaving the others waiting.

use super::Communicator;
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What one rank brings to a collective.
#[derive(Clone)]
enum Deposit {
    One(Tensor),
    /// One tensor per destination rank (all-to-all).
    Many(Vec<Tensor>),
}

/// One collective's meeting point.
struct Round {
    /// The collective's number in the group's sequence (which call this buffer holds).
    number: u64,
    kind: &'static str,
    /// What every rank must agree on besides the kind (all-gather's dimension).
    tag: usize,
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
}

struct State {
    /// Collective `n` meets in `rounds[n % 2]`: a rank is at most one collective ahead of the
    /// slowest, since it cannot leave collective `n` before every rank has arrived there.
    rounds: [Round; 2],
    /// Collectives each rank has entered.
    entered: Vec<u64>,
    /// Why the group stopped, once a rank gave up or a collective failed.
    failed: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    world: usize,
    timeout: Duration,
}

/// Builds a group of ranks in this process.
pub struct LocalGroup;

impl LocalGroup {
    /// `world` ranks (move each to its own thread); a collective fails on every rank once one
    /// rank has waited `timeout` for the others.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize, timeout: Duration) -> Result<Vec<LocalComm>> {
        if world == 0 {
            return Err(Error::InvalidOption("a group needs at least one rank".into()));
        }
        let round = || Round { number: u64::MAX, kind: "", tag: 0, deposits: vec![None; world], arrived: 0 };
        let shared = Arc::new(Shared {
            state: Mutex::new(State { rounds: [round(), round()], entered: vec![0; world], failed: None }),
            changed: Condvar::new(),
            world,
            timeout,
        });
        Ok((0..world).map(|rank| LocalComm { shared: shared.clone(), rank }).collect())
    }
}

/// One rank of a [`LocalGroup`].
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
}

impl LocalComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn error(&self, kind: &'static str, reason: String) -> Error {
        Error::Collective { collective: kind, rank: self.rank, world: self.shared.world, reason }
    }

    /// Stops the group with `reason` (the first reason wins) and wakes every waiting rank.
    fn fail(&self, st: &mut State, reason: String) {
        st.failed.get_or_insert(reason);
        self.shared.changed.notify_all();
    }

    /// Waits on the group until `ready` holds, the group fails or the timeout passes.
    fn wait_until<'a>(&self, mut st: MutexGuard<'a, State>, kind: &'static str, what: &str, ready: impl Fn(&State) -> bool) -> Result<MutexGuard<'a, State>> {
        // A timeout too long to add is no deadline.
        let deadline = Instant::now().checked_add(self.shared.timeout);
        loop {
            // A collective every rank completed succeeds even if the group failed since.
            if ready(&st) {
                return Ok(st);
            }
            if let Some(f) = &st.failed {
                return Err(self.error(kind, f.clone()));
            }
            let now = Instant::now();
            let Some(deadline) = deadline else {
                st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            if now >= deadline {
                let late: Vec<usize> = (0..self.shared.world).filter(|&r| st.entered[r] < st.entered[self.rank]).collect();
                let reason = format!("rank {} waited {:?} for {what}; ranks {late:?} had not arrived", self.rank, self.shared.timeout);
                self.fail(&mut st, reason.clone());
                return Err(self.error(kind, reason));
            }
            st = self.shared.changed.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Deposits `mine` for this rank's next collective and returns every rank's deposit, in
    /// rank order, once all have arrived.
    fn exchange(&self, kind: &'static str, tag: usize, mine: Deposit) -> Result<Vec<Deposit>> {
        let st = self.lock();
        let n = st.entered[self.rank];
        // The buffer held collective n − 2, which a rank has read before it enters n − 1; all
        // have entered n − 1 once this rank got through it, so this holds on arrival (kept as
        // the rule the buffers rely on).
        let mut st = self.wait_until(st, kind, "the collective before last to be read", |s| s.entered.iter().all(|&e| e >= n))?;
        let world = self.shared.world;
        let round = &mut st.rounds[(n % 2) as usize];
        if round.number != n {
            *round = Round { number: n, kind, tag, deposits: vec![None; world], arrived: 0 };
        }
        if round.kind != kind || round.tag != tag {
            let reason = format!("rank {} called {kind} ({tag}) where another rank called {} ({})", self.rank, round.kind, round.tag);
            self.fail(&mut st, reason.clone());
            return Err(self.error(kind, reason));
        }
        round.deposits[self.rank] = Some(mine);
        round.arrived += 1;
        st.entered[self.rank] = n + 1;
        self.shared.changed.notify_all();
        let st = self.wait_until(st, kind, "every rank's contribution", |s| {
            let r = &s.rounds[(n % 2) as usize];
            r.number == n && r.arrived == world
        })?;
        Ok(st.rounds[(n % 2) as usize].deposits.iter().map(|d| d.clone().expect("every rank arrived")).collect())
    }

    fn tensors(&self, kind: &'static str, all: Vec<Deposit>) -> Result<Vec<Tensor>> {
        all.into_iter()
            .map(|d| match d {
                Deposit::One(t) => Ok(t),
                Deposit::Many(_) => Err(self.error(kind, "a rank sent parts where one tensor was expected".into())),
            })
            .collect()
    }

    /// Fails the group when the ranks' tensors disagree where they must agree.
    fn check(&self, kind: &'static str, ok: bool, why: impl FnOnce() -> String) -> Result<()> {
        if ok {
            return Ok(());
        }
        let reason = why();
        self.fail(&mut self.lock(), reason.clone());
        Err(self.error(kind, reason))
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        const KIND: &str = "all_reduce_sum";
        let all = self.tensors(KIND, self.exchange(KIND, 0, Deposit::One(t.clone()))?)?;
        let same = all.iter().all(|x| x.dims() == t.dims() && x.dtype() == t.dtype());
        self.check(KIND, same, || format!("ranks sent {:?}", all.iter().map(|x| (x.dims().to_vec(), x.dtype())).collect::<Vec<_>>()))?;
        // In f32 and in rank order: the same bits on every rank.
        let mut sum = all[0].to_dtype(DType::F32)?;
        for x in &all[1..] {
            sum = (sum + x.to_dtype(DType::F32)?)?;
        }
        Ok(sum.to_dtype(t.dtype())?)
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const KIND: &str = "all_gather";
        let all = self.tensors(KIND, self.exchange(KIND, dim, Deposit::One(t.clone()))?)?;
        // Equal parts, as NCCL gathers: a group that runs here runs there.
        let fits = |x: &Tensor| x.dtype() == t.dtype() && x.dims() == t.dims();
        self.check(KIND, dim < t.rank() && all.iter().all(fits), || {
            format!("ranks sent {:?} to gather along {dim}", all.iter().map(|x| x.dims().to_vec()).collect::<Vec<_>>())
        })?;
        Ok(Tensor::cat(&all, dim)?)
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const KIND: &str = "all_to_all";
        let sent = parts.len();
        let all = self.exchange(KIND, 0, Deposit::Many(parts))?;
        let world = self.shared.world;
        let mut out = Vec::with_capacity(world);
        for d in all {
            match d {
                Deposit::Many(p) if p.len() == world => out.push(p[self.rank].clone()),
                _ => {
                    let reason = format!("all_to_all needs one part per rank ({world}); rank {} sent {sent}, another rank a different count", self.rank);
                    self.fail(&mut self.lock(), reason.clone());
                    return Err(self.error(KIND, reason));
                }
            }
        }
        Ok(out)
    }

    fn abort(&self, reason: &str) -> bool {
        let mut st = self.lock();
        let first = st.failed.is_none();
        self.fail(&mut st, reason.to_string());
        first
    }

    fn is_aborted(&self) -> bool {
        self.lock().failed.is_some()
    }

    fn reset(&self) {
        let mut st = self.lock();
        let world = self.shared.world;
        // No rank is inside a collective (the caller's promise): every count starts again.
        for round in &mut st.rounds {
            *round = Round { number: u64::MAX, kind: "", tag: 0, deposits: vec![None; world], arrived: 0 };
        }
        st.entered.iter_mut().for_each(|e| *e = 0);
        st.failed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const PATIENT: Duration = Duration::from_secs(20);

    /// Runs `f` on every rank of a group of `world`, each on its own thread.
    fn on_ranks<T: Send>(world: usize, timeout: Duration, f: impl Fn(&LocalComm) -> T + Sync) -> Vec<T> {
        let comms = LocalGroup::new(world, timeout).unwrap();
        std::thread::scope(|s| comms.iter().map(|c| s.spawn(|| f(c))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect())
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn collectives_give_every_rank_the_same_answer_call_after_call() {
        for world in [1, 2, 4] {
            let got = on_ranks(world, PATIENT, |c| {
                let r = c.rank() as f32;
                let mut seen = Vec::new();
                // Many collectives in a row, of changing shapes: the two buffers are reused.
                for step in 0..20 {
                    let n = 1 + step % 3;
                    let t = Tensor::from_vec((0..n).map(|i| r * 10.0 + i as f32 + step as f32).collect::<Vec<_>>(), n, &Device::Cpu).unwrap();
                    seen.push(values(&c.all_reduce_sum(&t).unwrap()));
                    let g = c.all_gather(&Tensor::full(r, (1, n), &Device::Cpu).unwrap(), 1).unwrap();
                    seen.push(values(&g));
                    let parts = (0..world).map(|j| Tensor::new(&[r * 100.0 + j as f32], &Device::Cpu).unwrap()).collect();
                    seen.push(c.all_to_all(parts).unwrap().iter().flat_map(values).collect());
                }
                seen
            });
            for (rank, seen) in got.iter().enumerate() {
                for step in 0..20 {
                    let n = 1 + step % 3;
                    let sum: Vec<f32> = (0..n).map(|i| (0..world).map(|r| r as f32 * 10.0 + i as f32 + step as f32).sum()).collect();
                    assert_eq!(seen[3 * step], sum, "world {world} rank {rank} step {step}");
                    let gathered: Vec<f32> = (0..world).flat_map(|r| vec![r as f32; n]).collect();
                    assert_eq!(seen[3 * step + 1], gathered);
                    let received: Vec<f32> = (0..world).map(|j| j as f32 * 100.0 + rank as f32).collect();
                    assert_eq!(seen[3 * step + 2], received);
                }
            }
        }
    }

    #[test]
    fn a_rank_that_gives_up_ends_every_ranks_collective() {
        let started = Instant::now();
        let got = on_ranks(4, PATIENT, |c| {
            if c.rank() == 2 {
                c.abort("rank 2 gave up: its launch failed");
                return Err(c.error("test", "aborted".into()));
            }
            c.all_reduce_sum(&Tensor::ones(3, DType::F32, &Device::Cpu).unwrap()).map(|_| ())
        });
        for (r, g) in got.iter().enumerate() {
            let e = g.as_ref().unwrap_err().to_string();
            assert!(r == 2 || e.contains("rank 2 gave up: its launch failed"), "rank {r}: {e}");
        }
        assert!(started.elapsed() < PATIENT / 2, "no rank waited out the timeout");
    }

    #[test]
    fn a_rank_that_never_comes_times_out_instead_of_hanging() {
        let started = Instant::now();
        let got = on_ranks(3, Duration::from_millis(200), |c| {
            if c.rank() == 1 {
                Ok(())
            } else {
                c.all_gather(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(), 0).map(|_| ())
            }
        });
        for r in [0, 2] {
            let e = got[r].as_ref().unwrap_err();
            assert!(matches!(e, Error::Collective { collective: "all_gather", .. }) && e.to_string().contains("[1]"), "rank {r}: {e}");
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn ranks_that_disagree_get_a_typed_error_not_a_wrong_answer() {
        let got = on_ranks(2, PATIENT, |c| c.all_reduce_sum(&Tensor::ones(1 + c.rank(), DType::F32, &Device::Cpu).unwrap()).map(|_| ()));
        assert!(got.iter().all(|g| matches!(g, Err(Error::Collective { .. }))), "{got:?}");
        let got = on_ranks(2, PATIENT, |c| match c.rank() {
            0 => c.all_reduce_sum(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap()).map(|_| ()),
            _ => c.all_gather(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(), 0).map(|_| ()),
        });
        assert!(got.iter().all(|g| matches!(g, Err(Error::Collective { .. }))), "{got:?}");
        let got = on_ranks(2, PATIENT, |c| c.all_to_all(vec![Tensor::ones(1, DType::F32, &Device::Cpu).unwrap()]).map(|_| ()));
        assert!(got.iter().all(|g| matches!(g, Err(Error::Collective { .. }))), "{got:?}");
        let got = on_ranks(2, PATIENT, |c| c.all_gather(&Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap(), c.rank()).map(|_| ()));
        assert!(got.iter().all(|g| matches!(g, Err(Error::Collective { .. }))), "gathered along different dims: {got:?}");
        let got = on_ranks(2, PATIENT, |c| c.all_gather(&Tensor::ones((1, 1 + c.rank()), DType::F32, &Device::Cpu).unwrap(), 1).map(|_| ()));
        assert!(got.iter().all(|g| matches!(g, Err(Error::Collective { .. }))), "unequal parts: {got:?}");
        assert!(LocalGroup::new(0, PATIENT).is_err());
    }
}
