//! The requests the engine core owns on a scheduler's behalf: the waiting queue, the admitted
//! set and their KV blocks. A scheduler decides who is admitted, preempted and given blocks;
//! the core adds requests and ends them, and ending one frees every block it holds, so no
//! policy can leak KV.

use super::SchedRequest;
use crate::kv::{BlockTable, KvManager};
use crate::request::RequestId;
use std::collections::{HashSet, VecDeque};

/// Waiting requests (in arrival order; a preempted one goes back to the head), the admitted
/// (running) ones and the KV bookkeeping, owned by the engine core and lent to the scheduler for
/// each `schedule` / `complete`.
#[derive(Debug)]
pub struct Requests {
    waiting: VecDeque<SchedRequest>,
    running: HashSet<RequestId>,
    kv: KvManager,
    preemptions: u64,
}

impl Requests {
    /// Requests over `kv`, none yet. The engine core makes one per engine; a test or a
    /// simulation that drives a scheduler without a model makes its own.
    pub fn new(kv: KvManager) -> Self {
        Self { waiting: VecDeque::new(), running: HashSet::new(), kv, preemptions: 0 }
    }

    /// Queues a validated request behind the others. The engine core's side (on
    /// `add_request`), like [`Requests::end`]: a scheduler never calls either.
    pub fn add(&mut self, request: SchedRequest) {
        self.waiting.push_back(request);
    }

    /// Ends a request's life here (the engine core, when it finishes, is aborted or fails): out
    /// of the queue or the admitted set, every KV block it holds freed. The core then calls the
    /// scheduler's `finished`. Unknown ids are ignored.
    pub fn end(&mut self, id: RequestId) {
        self.waiting.retain(|r| r.id != id);
        self.running.remove(&id);
        self.kv.free(id);
    }

    /// Waiting requests, head first.
    pub fn waiting(&self) -> impl ExactSizeIterator<Item = &SchedRequest> {
        self.waiting.iter()
    }

    /// The request at the head of the queue.
    pub fn front(&self) -> Option<&SchedRequest> {
        self.waiting.front()
    }

    /// Admits the request at the head of the queue if KV for `positions` cache positions can be
    /// reserved for it (all or nothing): it leaves the queue, running and holding its blocks.
    /// `None`: the queue is empty or the blocks are not free; nothing changes.
    pub fn admit_front(&mut self, positions: usize) -> Option<SchedRequest> {
        let id = self.waiting.front()?.id;
        self.admit(id, positions)
    }

    /// [`Requests::admit_front`] for any waiting request (a policy that admits out of order).
    pub fn admit(&mut self, id: RequestId, positions: usize) -> Option<SchedRequest> {
        let index = self.waiting.iter().position(|r| r.id == id)?;
        if !self.kv.reserve(id, positions) {
            return None;
        }
        self.running.insert(id);
        self.waiting.remove(index)
    }

    /// Grows a running request's tables to cover `positions` cache positions (all or nothing).
    /// False when the blocks are not free or the request is not running.
    pub fn reserve(&mut self, id: RequestId, positions: usize) -> bool {
        self.running.contains(&id) && self.kv.reserve(id, positions)
    }

    /// Gives a running request's blocks back before it ends (it stays running): for a policy
    /// that knows nothing will read them again, e.g. once its last launch is issued.
    pub fn free_kv(&mut self, id: RequestId) {
        if self.running.contains(&id) {
            self.kv.free(id);
        }
    }

    /// Preempts a running request: its blocks are freed and `resume` — what it must recompute,
    /// under its own id — goes to the head of the queue, to be admitted again before any other.
    /// Ignored for a request that is not running.
    pub fn preempt(&mut self, resume: SchedRequest) {
        if self.running.remove(&resume.id) {
            self.kv.free(resume.id);
            self.preemptions += 1;
            self.waiting.push_front(resume);
        }
    }

    /// A running request's block tables, indexed by cache slot.
    pub fn tables(&self, id: RequestId) -> Option<&[BlockTable]> {
        self.kv.tables(id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Requests preempted so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64) -> SchedRequest {
        SchedRequest { id: RequestId(id), prompt: vec![1; 5], max_new_tokens: 1 }
    }

    #[test]
    fn admission_reserves_all_or_nothing_and_release_frees_every_block() {
        let mut q = Requests::new(KvManager::new(8, 4, 1));
        for i in 0..3 {
            q.add(req(i));
        }
        assert!(q.admit_front(33).is_none(), "9 blocks do not fit 8");
        assert_eq!((q.num_waiting(), q.num_running(), q.kv().num_used_blocks()), (3, 0, 0));
        assert_eq!(q.admit(RequestId(1), 6).map(|r| r.id), Some(RequestId(1)), "out of order");
        assert_eq!((q.num_waiting(), q.num_running(), q.kv().num_used_blocks()), (2, 1, 2));
        assert!(q.reserve(RequestId(1), 12));
        assert!(!q.reserve(RequestId(0), 4), "only a running request is given blocks");
        assert_eq!(q.kv().num_used_blocks(), 3);
        q.end(RequestId(1));
        assert_eq!((q.num_waiting(), q.num_running(), q.kv().num_used_blocks()), (2, 0, 0));
        assert_eq!(q.admit_front(8).map(|r| r.id), Some(RequestId(0)));
        q.end(RequestId(2));
        assert_eq!(q.num_waiting(), 0, "a waiting request is released too");
        q.end(RequestId(0));
        assert_eq!((q.num_running(), q.kv().num_used_blocks()), (0, 0));
    }

    #[test]
    fn a_preempted_request_goes_first_without_its_blocks() {
        let mut q = Requests::new(KvManager::new(8, 4, 2));
        q.add(req(0));
        q.add(req(1));
        let r = q.admit_front(5).unwrap();
        assert_eq!(q.kv().num_used_blocks(), 4);
        q.preempt(SchedRequest { prompt: vec![1; 6], ..r });
        assert_eq!((q.num_running(), q.kv().num_used_blocks(), q.preemptions()), (0, 0, 1));
        assert_eq!(q.front().map(|r| (r.id, r.prompt.len())), Some((RequestId(0), 6)));
        q.preempt(req(1));
        assert_eq!((q.num_waiting(), q.preemptions()), (2, 1), "a waiting request is not preempted");
        let r = q.admit_front(4).unwrap();
        q.free_kv(r.id);
        assert_eq!((q.num_running(), q.kv().num_used_blocks()), (1, 0), "blocks back early, still running");
    }
}
