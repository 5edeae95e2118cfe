//! The bookkeeping every scheduler needs whatever its policy: requests waiting for admission
//! in arrival order, and the KV manager that admitted requests hold blocks of.

use super::SchedRequest;
use crate::kv::KvManager;
use crate::request::RequestId;
use std::collections::VecDeque;

/// Waiting requests (first come first served) and the KV bookkeeping of a scheduler. A
/// scheduler keeps its running requests in whatever shape its policy needs and calls
/// [`Requests::forget`] from `finish`, which drops a waiting request and frees its blocks.
#[derive(Debug)]
pub struct Requests {
    waiting: VecDeque<SchedRequest>,
    kv: KvManager,
}

impl Requests {
    pub fn new(kv: KvManager) -> Self {
        Self { waiting: VecDeque::new(), kv }
    }
    /// Queues a request behind the others.
    pub fn push(&mut self, request: SchedRequest) {
        self.waiting.push_back(request);
    }
    /// Puts a request back at the head of the queue (a preempted one goes first).
    pub fn push_front(&mut self, request: SchedRequest) {
        self.waiting.push_front(request);
    }
    pub fn front(&self) -> Option<&SchedRequest> {
        self.waiting.front()
    }
    /// Admits the request at the head of the queue if KV for `positions` cache positions can be
    /// reserved for it (all or nothing): it leaves the queue holding its blocks. `None`: the
    /// queue is empty or the blocks are not free; nothing changes.
    pub fn admit_front(&mut self, positions: usize) -> Option<SchedRequest> {
        let id = self.waiting.front()?.id;
        if !self.kv.reserve(id, positions) {
            return None;
        }
        self.waiting.pop_front()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }
    pub fn kv_mut(&mut self) -> &mut KvManager {
        &mut self.kv
    }
    /// Drops `id` from the queue if it is waiting and frees every KV block it holds.
    pub fn forget(&mut self, id: RequestId) {
        self.waiting.retain(|r| r.id != id);
        self.kv.free(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forget_drops_the_waiting_request_and_frees_its_blocks() {
        let mut q = Requests::new(KvManager::new(8, 4, 1));
        for i in 0..3 {
            q.push(SchedRequest { id: RequestId(i), prompt: vec![1; 5], max_new_tokens: 1 });
        }
        assert!(q.kv_mut().reserve(RequestId(1), 6));
        assert_eq!(q.kv().num_used_blocks(), 2);
        q.forget(RequestId(1));
        assert_eq!((q.num_waiting(), q.kv().num_used_blocks()), (2, 0));
        // Admission reserves for the head of the queue, all or nothing.
        assert!(q.admit_front(33).is_none(), "9 blocks do not fit 8");
        assert_eq!((q.num_waiting(), q.kv().num_used_blocks()), (2, 0));
        assert_eq!(q.admit_front(8).map(|r| r.id), Some(RequestId(0)));
        assert_eq!((q.num_waiting(), q.kv().num_used_blocks()), (1, 2));
        q.forget(RequestId(0));
        assert_eq!(q.admit_front(1).map(|r| r.id), Some(RequestId(2)));
        q.forget(RequestId(2));
        q.push_front(SchedRequest { id: RequestId(9), prompt: vec![1], max_new_tokens: 1 });
        assert_eq!(q.front().map(|r| r.id), Some(RequestId(9)));
    }
}
