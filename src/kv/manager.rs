//! Block tables per (request, slot) over one [`BlockPool`].

use super::{BlockPool, KvLayout};
use crate::request::RequestId;
use std::collections::HashMap;
use std::sync::Arc;

/// One slot's block ids of one request, in position order. Shared, so a launch carries its rows'
/// tables by reference count instead of copying them; growing a table makes a new one.
pub type BlockTable = Arc<[u32]>;

/// Host-side KV bookkeeping owned by a scheduler: allocation, capacity accounting, and the
/// block tables that launches carry to the device.
#[derive(Debug)]
pub struct KvManager {
    pool: BlockPool,
    block_size: usize,
    layout: Box<dyn KvLayout>,
    num_slots: usize,
    tables: HashMap<RequestId, Vec<BlockTable>>,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize, layout: Box<dyn KvLayout>, max_steps: usize) -> Self {
        let num_slots = layout.num_slots(max_steps);
        Self { pool: BlockPool::new(num_blocks), block_size, layout, num_slots, tables: HashMap::new() }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn layout(&self) -> &dyn KvLayout {
        self.layout.as_ref()
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

    /// Block table of `id` for the slot that loop step `step` uses.
    pub fn table_for_step(&self, id: RequestId, step: usize) -> &[u32] {
        &self.tables[&id][self.layout.slot_for_step(step)]
    }

    /// All of `id`'s tables, indexed by slot.
    pub fn tables(&self, id: RequestId) -> Option<&[BlockTable]> {
        self.tables.get(&id).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{DepthIndexed, Shared};

    #[test]
    fn depth_indexed_reserves_every_slot() {
        let mut kv = KvManager::new(16, 4, Box::new(DepthIndexed), 4);
        let id = RequestId(1);
        assert_eq!(kv.blocks_for(5), 8);
        assert!(kv.reserve(id, 5));
        assert_eq!(kv.num_used_blocks(), 8);
        assert!(kv.reserve(id, 8)); // still 2 blocks per slot
        assert_eq!(kv.num_used_blocks(), 8);
        assert!(!kv.reserve(id, 100));
        assert_eq!(kv.num_used_blocks(), 8, "failed reserve must not leak");
        let t0 = kv.table_for_step(id, 0).to_vec();
        let t3 = kv.table_for_step(id, 3).to_vec();
        assert_ne!(t0, t3);
        kv.free(id);
        kv.free(id);
        assert_eq!(kv.num_used_blocks(), 0);
    }

    #[test]
    fn shared_uses_one_slot() {
        let mut kv = KvManager::new(4, 16, Box::new(Shared), 4);
        assert!(kv.reserve(RequestId(0), 17));
        assert_eq!(kv.num_used_blocks(), 2);
        assert_eq!(kv.table_for_step(RequestId(0), 0), kv.table_for_step(RequestId(0), 3));
    }
}
