//! A looped scheduler driven as the engine core drives it, without a model (unit tests).

use super::{LoopedLaunch, LoopedResult, LoopedScheduler};
use crate::kv::KvManager;
use crate::request::RequestId;
use crate::scheduler::{Requests, SchedRequest};

pub(crate) struct Driven<S> {
    pub s: S,
    pub requests: Requests,
}

impl<S: LoopedScheduler> Driven<S> {
    pub fn new(s: S, kv: KvManager) -> Self {
        Self { s, requests: Requests::new(kv) }
    }
    pub fn add(&mut self, r: SchedRequest) {
        self.requests.add(r);
    }
    pub fn schedule(&mut self) -> Option<LoopedLaunch> {
        self.s.schedule(&mut self.requests)
    }
    pub fn complete(&mut self, launch: &LoopedLaunch, result: &LoopedResult) {
        self.s.complete(&mut self.requests, launch, result);
    }
    /// Ends a request as the core does: its blocks freed, then the scheduler told.
    pub fn finish(&mut self, id: RequestId) {
        self.requests.end(id);
        self.s.finished(id);
    }
    pub fn kv(&self) -> &KvManager {
        self.requests.kv()
    }
    pub fn num_waiting(&self) -> usize {
        self.requests.num_waiting()
    }
    pub fn preemptions(&self) -> u64 {
        self.requests.preemptions()
    }
}
