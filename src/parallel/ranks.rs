//! The ranks of one engine at work: a thread per rank, each owning its rank's runner (its shard
//! of the model and the K/V of its heads). The engine hands every rank the same launch — plain
//! data — and takes back one result; the ranks meet only in their model's collectives.
//!
//! A rank whose launch fails (an error or a panic) aborts the group before it reports, so that
//! ranks waiting for it in a collective fail at once instead of at their timeout; the error the
//! launch fails with is that rank's. A job already queued behind the failed one (overlap) fails
//! the same way. Once no job is left in flight the group is reset — every rank first runs the
//! engine's `on_reset` (drop what was captured against the old group, drain the device), then
//! the communicators are rebuilt — and the next launch runs as usual: one failed launch fails
//! its requests, not the engine.

use super::Communicator;
use crate::{Error, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Work for every rank: called with the rank's index and its runner.
pub(crate) type RankJob<R, T> = Arc<dyn Fn(usize, &mut R) -> Result<T> + Send + Sync>;

/// What every rank runs before its group is rebuilt after a failure.
pub(crate) type OnReset<R> = Arc<dyn Fn(&mut R) + Send + Sync>;

type Task<R> = Box<dyn FnOnce(&mut R) + Send>;

/// A rank's answer, and whether its failure was the one that aborted the group.
type Answer<T> = (Result<T>, bool);

/// A thread per rank, each owning one `R`.
pub(crate) struct Ranks<R: Send + 'static> {
    tasks: Vec<Sender<Task<R>>>,
    threads: Vec<JoinHandle<()>>,
    /// Each rank's thread says here when it ends.
    exited: Receiver<()>,
    comms: Vec<Arc<dyn Communicator>>,
    on_reset: Option<OnReset<R>>,
    /// How long a job may take before the group is aborted (see [`Ranks::wait`]).
    timeout: Duration,
    /// Why the ranks can no longer run anything (a rank that did not answer even after the
    /// group was aborted: its thread is stuck in the device).
    broken: Option<String>,
    /// Jobs dispatched so far (a job's number is its place in every rank's queue).
    dispatched: u64,
    /// Jobs numbered up to this one were queued before the last reset: their failures are
    /// the one that reset already answers.
    reset_after: u64,
}

/// Every rank's answer to one job, still on its way ([`Ranks::wait`]).
pub(crate) struct RanksPending<T> {
    answers: Vec<Receiver<Answer<T>>>,
    number: u64,
}

impl<R: Send + 'static> Ranks<R> {
    /// Moves `runners[r]` onto rank r's thread; `comms[r]` is rank r's communicator (aborted
    /// when its job fails, or when a job has run `timeout` without every rank answering);
    /// `on_reset` runs on every rank before its group is rebuilt.
    pub(crate) fn spawn(runners: Vec<R>, comms: Vec<Arc<dyn Communicator>>, timeout: Duration, on_reset: Option<OnReset<R>>) -> Result<Self> {
        if runners.is_empty() || runners.len() != comms.len() {
            return Err(Error::InvalidOption(format!("{} ranks with {} communicators", runners.len(), comms.len())));
        }
        let mut tasks = Vec::with_capacity(runners.len());
        let mut threads = Vec::with_capacity(runners.len());
        let (exited_tx, exited) = crossbeam_channel::unbounded();
        for (rank, mut runner) in runners.into_iter().enumerate() {
            let (tx, rx) = crossbeam_channel::unbounded::<Task<R>>();
            let exited_tx = exited_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("ponder-rank-{rank}"))
                .spawn(move || {
                    // Ends when the engine drops its sender.
                    for task in rx {
                        task(&mut runner);
                    }
                    drop(runner);
                    let _ = exited_tx.send(());
                })
                .map_err(|e| Error::InvalidOption(format!("could not start rank {rank}'s thread: {e}")))?;
            tasks.push(tx);
            threads.push(thread);
        }
        Ok(Self { tasks, threads, exited, comms, on_reset, timeout, broken: None, dispatched: 0, reset_after: 0 })
    }

    pub(crate) fn world(&self) -> usize {
        self.tasks.len()
    }

    /// Starts `job` on every rank at once, behind whatever each rank has queued; [`Ranks::wait`]
    /// gives their answers. A job that succeeds on a group that was aborted meanwhile (a
    /// replayed CUDA graph's collectives end early, without an error) answers with an error.
    pub(crate) fn run<T: Send + 'static>(&mut self, job: RankJob<R, T>) -> RanksPending<T> {
        self.dispatched += 1;
        let world = self.world();
        let mut answers = Vec::with_capacity(world);
        for (rank, tasks) in self.tasks.iter().enumerate() {
            let (tx, rx) = crossbeam_channel::bounded(1);
            if let Some(why) = &self.broken {
                let _ = tx.send((Err(Error::Collective { collective: "launch", rank, world, reason: why.clone() }), false));
                answers.push(rx);
                continue;
            }
            let (job, comm) = (job.clone(), self.comms[rank].clone());
            let task: Task<R> = Box::new(move |runner: &mut R| {
                let answer = match std::panic::catch_unwind(AssertUnwindSafe(|| job(rank, runner))) {
                    Ok(Ok(_)) if comm.is_aborted() => Err(Error::Collective {
                        collective: "launch",
                        rank,
                        world,
                        reason: "the group was aborted while this launch ran: its results are not the model's".into(),
                    }),
                    Ok(answer) => answer,
                    Err(panic) => Err(Error::Collective { collective: "launch", rank, world, reason: format!("rank {rank} panicked: {}", panic_text(&panic)) }),
                };
                let first = match &answer {
                    Err(e) => comm.abort(&format!("rank {rank} failed: {e}")),
                    Ok(_) => false,
                };
                // The engine may have stopped waiting (dropped): nothing to tell then.
                let _ = tx.send((answer, first));
            });
            if tasks.send(task).is_err() {
                // The thread is gone (it only ends when the engine drops it): answer for it.
                let why = format!("rank {rank}'s thread has stopped");
                let first = self.comms[rank].abort(&why);
                let (tx, rx) = crossbeam_channel::bounded(1);
                let _ = tx.send((Err(Error::Collective { collective: "launch", rank, world, reason: why }), first));
                answers.push(rx);
                continue;
            }
            answers.push(rx);
        }
        RanksPending { answers, number: self.dispatched }
    }

    /// Every rank's answer to a started job, in rank order, or the error that started a
    /// failure: the error of the rank whose failure aborted the group, not the collective
    /// errors it caused on the others.
    ///
    /// A rank that has not answered `timeout` after the wait began gets its group aborted
    /// (the GPU collectives it may be stuck in end), and the job fails even if every rank then
    /// answers; it has another `timeout` to answer, and one that still does not is stuck beyond
    /// recovery: every later job fails at once.
    ///
    /// A failure queues the group's reset behind every job already dispatched (those fail
    /// too: their group is down); jobs started after it run on the rebuilt group, however
    /// many launches the engine keeps in flight.
    pub(crate) fn wait<T>(&mut self, pending: RanksPending<T>) -> Result<Vec<T>> {
        let world = self.world();
        let mut out = Vec::with_capacity(world);
        let mut errors: Vec<(Error, bool)> = Vec::new();
        let mut deadline = Instant::now().checked_add(self.timeout);
        let mut overstayed: Option<Error> = None;
        for (rank, rx) in pending.answers.iter().enumerate() {
            let answer = loop {
                let Some(until) = deadline else {
                    break rx.recv().map_err(|_| RecvTimeoutError::Disconnected);
                };
                match rx.recv_deadline(until) {
                    Err(RecvTimeoutError::Timeout) if overstayed.is_none() => {
                        // Every rank without an answer yet (one waiting in a collective for a
                        // slow one looks the same from here).
                        let late: Vec<usize> = (rank..world).filter(|&r| pending.answers[r].is_empty()).collect();
                        let why = format!("ranks {late:?} had not finished their launch after {:?}", self.timeout);
                        for comm in &self.comms {
                            comm.abort(&why);
                        }
                        overstayed = Some(Error::Collective { collective: "launch", rank, world, reason: why });
                        deadline = Instant::now().checked_add(self.timeout);
                    }
                    other => break other,
                }
            };
            match answer {
                Ok((Ok(t), _)) => out.push(t),
                Ok((Err(e), first)) => errors.push((e, first)),
                Err(RecvTimeoutError::Timeout) => {
                    let why = format!("rank {rank} is stuck: no answer {:?} after its group was aborted", self.timeout);
                    self.broken = Some(why.clone());
                    errors.push((Error::Collective { collective: "launch", rank, world, reason: why }, true));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    errors.push((Error::Collective { collective: "launch", rank, world, reason: "the rank stopped without answering".into() }, false))
                }
            }
        }
        if errors.is_empty() && overstayed.is_none() {
            return Ok(out);
        }
        if self.broken.is_none() && pending.number > self.reset_after {
            self.queue_reset();
        }
        // A stuck rank is the news; then a rank that overstayed; then the rank whose own
        // failure aborted the group.
        if let Some(stuck) = errors.iter().position(|(e, _)| matches!(e, Error::Collective { reason, .. } if self.broken.as_ref() == Some(reason))) {
            return Err(errors.swap_remove(stuck).0);
        }
        if let Some(e) = overstayed {
            return Err(e);
        }
        let cause = errors.iter().position(|(_, first)| *first).unwrap_or(0);
        Err(errors.swap_remove(cause).0)
    }

    /// Queues the group's reset on every rank, behind what each has queued: every rank runs
    /// `on_reset`, all meet (no rank is inside a collective then), rank 0 rebuilds the group,
    /// all meet again, and the ranks go on with their queues.
    fn queue_reset(&mut self) {
        self.reset_after = self.dispatched;
        let barrier = Arc::new(std::sync::Barrier::new(self.world()));
        for (rank, tasks) in self.tasks.iter().enumerate() {
            let (hook, barrier) = (self.on_reset.clone(), barrier.clone());
            let comms = (rank == 0).then(|| self.comms.clone());
            let task: Task<R> = Box::new(move |runner: &mut R| {
                if let Some(hook) = hook {
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| hook(runner)));
                }
                barrier.wait();
                for comm in comms.iter().flatten() {
                    comm.reset();
                }
                barrier.wait();
            });
            let _ = tasks.send(task);
        }
    }
}

impl<R: Send + 'static> Drop for Ranks<R> {
    fn drop(&mut self) {
        // Closing the channels ends each thread after what it has queued. A thread that does
        // not end within the timeout (stuck in a collective or in the device) gets its group
        // aborted and another timeout; one still running then is left to the process rather
        // than waited for.
        self.tasks.clear();
        if self.broken.is_some() {
            return;
        }
        let world = self.threads.len();
        let mut ended = 0;
        for round in 0..2 {
            let until = Instant::now().checked_add(self.timeout);
            while ended < world {
                let got = match until {
                    Some(t) => self.exited.recv_deadline(t).is_ok(),
                    None => self.exited.recv().is_ok(),
                };
                if !got {
                    break;
                }
                ended += 1;
            }
            if ended == world {
                for t in self.threads.drain(..) {
                    let _ = t.join();
                }
                return;
            }
            if round == 0 {
                for comm in &self.comms {
                    comm.abort("the engine is shutting down");
                }
            }
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::LocalGroup;
    use candle_core::{DType, Device, Tensor};
    use std::time::{Duration, Instant};

    type Comms = Vec<Arc<dyn Communicator>>;

    /// A group's communicators twice: as the ranks' runners, and as their communicators.
    fn group(world: usize) -> (Comms, Comms) {
        let comms: Vec<Arc<dyn Communicator>> =
            LocalGroup::new(world, Duration::from_secs(20)).unwrap().into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
        (comms.clone(), comms)
    }

    /// Each rank owns its communicator: a job sums the ranks' values.
    fn sum_job() -> RankJob<Arc<dyn Communicator>, f32> {
        Arc::new(|rank, c: &mut Arc<dyn Communicator>| {
            let t = Tensor::new(&[rank as f32 + 1.0], &Device::Cpu)?;
            Ok(c.all_reduce_sum(&t)?.to_vec1::<f32>()?[0])
        })
    }

    #[test]
    fn every_rank_runs_the_job_and_answers_in_rank_order() {
        let (runners, comms) = group(3);
        let mut ranks = Ranks::spawn(runners, comms, Duration::from_secs(20), None).unwrap();
        for _ in 0..5 {
            let p = ranks.run(sum_job());
            assert_eq!(ranks.wait(p).unwrap(), vec![6.0; 3]);
        }
        // Two jobs in flight at once (overlap): each rank runs them in order.
        let (a, b) = (ranks.run(sum_job()), ranks.run(sum_job()));
        assert_eq!((ranks.wait(a).unwrap(), ranks.wait(b).unwrap()), (vec![6.0; 3], vec![6.0; 3]));
        let ranked: RankJob<Arc<dyn Communicator>, usize> = Arc::new(|rank, _| Ok(rank));
        let p = ranks.run(ranked);
        assert_eq!(ranks.wait(p).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn a_failing_or_panicking_rank_fails_the_job_on_time_and_the_next_job_runs() {
        let (runners, comms) = group(4);
        let mut ranks = Ranks::spawn(runners, comms, Duration::from_secs(20), None).unwrap();
        let mut run = |job| {
            let p = ranks.run(job);
            ranks.wait(p)
        };
        let started = Instant::now();
        let failing: RankJob<Arc<dyn Communicator>, f32> = Arc::new(|rank, c: &mut Arc<dyn Communicator>| {
            if rank == 2 {
                return Err(Error::InvalidOption("rank 2's own failure".into()));
            }
            Ok(c.all_reduce_sum(&Tensor::ones(1, DType::F32, &Device::Cpu)?)?.to_vec1::<f32>()?[0])
        });
        let e = run(failing.clone()).unwrap_err();
        assert!(matches!(&e, Error::InvalidOption(m) if m.contains("rank 2's own failure")), "the cause, not the others' aborted collectives: {e}");
        assert_eq!(run(sum_job()).unwrap(), vec![10.0; 4], "the group works again");
        let panicking: RankJob<Arc<dyn Communicator>, f32> = Arc::new(|rank, c: &mut Arc<dyn Communicator>| {
            if rank == 0 {
                panic!("a bug on rank 0");
            }
            Ok(c.all_reduce_sum(&Tensor::ones(1, DType::F32, &Device::Cpu)?)?.to_vec1::<f32>()?[0])
        });
        let e = run(panicking).unwrap_err();
        assert!(e.to_string().contains("a bug on rank 0"), "{e}");
        assert_eq!(run(sum_job()).unwrap(), vec![10.0; 4]);
        // A job queued behind a failing one fails too (the group is down until both are waited
        // for), and the one after them runs.
        let (a, b) = (ranks.run(failing), ranks.run(sum_job()));
        assert!(ranks.wait(a).is_err());
        assert!(matches!(ranks.wait(b), Err(Error::Collective { .. })));
        let p = ranks.run(sum_job());
        assert_eq!(ranks.wait(p).unwrap(), vec![10.0; 4]);
        assert!(started.elapsed() < Duration::from_secs(10), "no rank waited out its timeout");
    }

    /// A rank that overstays the timeout outside any collective (a device stuck in a kernel):
    /// the group is aborted so the others stop waiting; one that answers late leaves the ranks
    /// usable, one that never does leaves them failing every job at once, without hanging.
    #[test]
    fn a_rank_that_overstays_the_timeout_gets_its_group_aborted() {
        let patience = Duration::from_millis(300);
        let (runners, comms) = group(2);
        let mut ranks = Ranks::spawn(runners, comms, patience, None).unwrap();
        let slow = |sleep: Duration| -> RankJob<Arc<dyn Communicator>, f32> {
            Arc::new(move |rank, c: &mut Arc<dyn Communicator>| {
                if rank == 1 {
                    std::thread::sleep(sleep);
                }
                Ok(c.all_reduce_sum(&Tensor::ones(1, DType::F32, &Device::Cpu)?)?.to_vec1::<f32>()?[0])
            })
        };
        let started = Instant::now();
        let p = ranks.run(slow(Duration::from_millis(450)));
        let e = ranks.wait(p).unwrap_err();
        assert!(matches!(&e, Error::Collective { reason, .. } if reason.contains("[0, 1] had not finished")), "the ranks without an answer: {e}");
        assert!(started.elapsed() < Duration::from_secs(2));
        let p = ranks.run(sum_job());
        assert_eq!(ranks.wait(p).unwrap(), vec![3.0; 2], "the late rank answered: the group works again");
        let p = ranks.run(slow(Duration::from_millis(1500)));
        assert!(ranks.wait(p).unwrap_err().to_string().contains("stuck"));
        let started = Instant::now();
        let p = ranks.run(sum_job());
        assert!(ranks.wait(p).unwrap_err().to_string().contains("stuck"), "later jobs fail at once");
        assert!(started.elapsed() < Duration::from_millis(100));
    }
}

#[cfg(test)]
mod reset_tests {
    use super::*;
    use crate::parallel::LocalGroup;
    use candle_core::{DType, Device, Tensor};

    /// A rank's runner that counts its resets.
    struct Counting {
        comm: Arc<dyn Communicator>,
        resets: usize,
    }

    /// A job whose ranks all answer, slowly on rank 1, with every collective done in time: the
    /// overstay still fails it (the group was aborted under it), every rank runs `on_reset`,
    /// and the next job runs; a job dropped without waiting does not keep the group down.
    #[test]
    fn an_aborted_group_is_reset_through_every_ranks_hook() {
        let comms: Vec<Arc<dyn Communicator>> =
            LocalGroup::new(2, Duration::from_secs(20)).unwrap().into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
        let runners = comms.iter().map(|c| Counting { comm: c.clone(), resets: 0 }).collect();
        let hook: OnReset<Counting> = Arc::new(|r: &mut Counting| r.resets += 1);
        let mut ranks = Ranks::spawn(runners, comms, Duration::from_millis(200), Some(hook)).unwrap();
        let late: RankJob<Counting, ()> = Arc::new(|rank, _| {
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(300));
            }
            Ok(())
        });
        let p = ranks.run(late);
        assert!(ranks.wait(p).is_err(), "the group was aborted under the job");
        let job: RankJob<Counting, (f32, usize)> = Arc::new(|_, r: &mut Counting| {
            let s = r.comm.all_reduce_sum(&Tensor::ones(1, DType::F32, &Device::Cpu)?)?.to_vec1::<f32>()?[0];
            Ok((s, r.resets))
        });
        let p = ranks.run(job.clone());
        assert_eq!(ranks.wait(p).unwrap(), vec![(2.0, 1), (2.0, 1)], "reset once, through every rank's hook");
        // Overlap: a failing job with another already queued behind it (which fails too), and
        // the next issued before that one is waited for: it runs on the rebuilt group, and one
        // failure is one reset.
        let failing: RankJob<Counting, (f32, usize)> = Arc::new(|rank, r: &mut Counting| {
            if rank == 1 {
                return Err(Error::InvalidOption("rank 1 fails".into()));
            }
            let s = r.comm.all_reduce_sum(&Tensor::ones(1, DType::F32, &Device::Cpu)?)?.to_vec1::<f32>()?[0];
            Ok((s, r.resets))
        });
        let (a, b) = (ranks.run(failing), ranks.run(job.clone()));
        assert!(ranks.wait(a).unwrap_err().to_string().contains("rank 1 fails"));
        let c = ranks.run(job.clone());
        assert!(ranks.wait(b).is_err(), "queued on the aborted group");
        assert_eq!(ranks.wait(c).unwrap(), vec![(2.0, 2), (2.0, 2)], "after the second reset, and only it");
        // A failure, then a job dropped unwaited: the group is reset before the next one runs.
        let failing: RankJob<Counting, ()> = Arc::new(|rank, _| if rank == 0 { Err(Error::InvalidOption("no".into())) } else { Ok(()) });
        let p = ranks.run(failing);
        assert!(ranks.wait(p).is_err());
        drop(ranks.run(job.clone()));
        let p = ranks.run(job);
        assert!(ranks.wait(p).is_ok());
    }
}
