//! Block tables per (request, slot) over one [`BlockPool`].

use super::BlockPool;
use crate::request::RequestId;
use std::collections::HashMap;
use std::sync::Arc;

/// One slot's block ids of one request, in position order. Shared, so a launch carries its rows'
/// tables by reference count instead of copying them; growing a table makes a new one.
pub type BlockTable = Arc<[u32]>;

/// Host-side KV bookkeeping, held in the core's `Requests` and lent to the scheduler with them:
/// allocation, capacity accounting, and the
/// block tables that launches carry to the device. A request holds one table per cache slot
/// (`num_slots`: what a slot means is the family's — a looped model's KV layout maps its loop
/// steps onto slots; a diffusion model has one).
#[derive(Debug)]
pub struct KvManager {
    pool: BlockPool,
    block_size: usize,
    num_slots: usize,
    tables: HashMap<RequestId, Vec<BlockTable>>,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize, num_slots: usize) -> Self {
        Self { pool: BlockPool::new(num_blocks), block_size, num_slots: num_slots.max(1), tables: HashMap::new() }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
    pub fn num_used_blocks(&self) -> usize {
        self.pool.num_used()
    }
    /// Requests holding blocks.
    pub fn num_resident(&self) -> usize {
        self.tables.len()
    }

    /// Blocks a request of `tokens` positions holds in total (all slots).
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.num_slots * tokens.div_ceil(self.block_size)
    }

    /// Blocks still to allocate so that `id` covers `tokens` positions in every slot.
    pub fn blocks_missing(&self, id: RequestId, tokens: usize) -> usize {
        let have = self.tables.get(&id).map_or(0, |t| t[0].len());
        self.num_slots * tokens.div_ceil(self.block_size).saturating_sub(have)
    }

    /// Grows `id`'s tables to cover `tokens` positions in every slot. All or nothing: returns
    /// false (and allocates nothing) if the pool cannot supply every missing block.
    pub fn reserve(&mut self, id: RequestId, tokens: usize) -> bool {
        let missing = self.blocks_missing(id, tokens);
        if missing > self.pool.num_free() {
            return false;
        }
        let per_slot = tokens.div_ceil(self.block_size);
        let slots = self.num_slots;
        let tables = self.tables.entry(id).or_insert_with(|| vec![BlockTable::from([]); slots]);
        for table in tables.iter_mut() {
            if table.len() < per_slot {
                let mut grown = table.to_vec();
                while grown.len() < per_slot {
                    grown.push(self.pool.allocate().expect("checked free count"));
                }
                *table = grown.into();
            }
        }
        true
    }

    /// Returns every block of `id` to the pool. Unknown ids are ignored (idempotent).
    pub fn free(&mut self, id: RequestId) {
        if let Some(tables) = self.tables.remove(&id) {
            for b in tables.iter().flat_map(|t| t.iter()) {
                self.pool.release(*b);
            }
        }
    }

    /// All of `id`'s tables, indexed by slot.
    pub fn tables(&self, id: RequestId) -> Option<&[BlockTable]> {
        self.tables.get(&id).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_takes_blocks_in_every_slot_all_or_nothing() {
        let mut kv = KvManager::new(16, 4, 4);
        let id = RequestId(1);
        assert_eq!(kv.blocks_for(5), 8);
        assert!(kv.reserve(id, 5));
        assert_eq!(kv.num_used_blocks(), 8);
        assert!(kv.reserve(id, 8)); // still 2 blocks per slot
        assert_eq!(kv.num_used_blocks(), 8);
        assert!(!kv.reserve(id, 100));
        assert_eq!(kv.num_used_blocks(), 8, "failed reserve must not leak");
        let tables = kv.tables(id).unwrap();
        assert_eq!(tables.len(), 4);
        assert_ne!(tables[0], tables[3]);
        kv.free(id);
        kv.free(id);
        assert_eq!(kv.num_used_blocks(), 0);
    }

    #[test]
    fn one_slot_holds_one_table() {
        let mut kv = KvManager::new(4, 16, 1);
        assert!(kv.reserve(RequestId(0), 17));
        assert_eq!(kv.num_used_blocks(), 2);
        assert_eq!(kv.tables(RequestId(0)).unwrap().len(), 1);
    }
}
