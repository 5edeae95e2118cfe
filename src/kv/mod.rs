//! The paged KV cache: host-side block bookkeeping (pool, per-(request, slot) block tables,
//! layouts that map loop steps to slots) and the device-side store the pool indexes.
//!
//! One block id addresses `block_size` token positions in *every* physical attention layer's
//! cache tensor. A request owns one block table per cache slot; a layout says which slot a loop
//! step reads and writes. So rows at different depths share one attention launch: each row
//! simply brings the block table of its slot.

mod budget;
mod manager;
mod pool;
mod store;

pub(crate) use budget::{check_fits, kv_bytes, workspace_bytes, MemoryNeed, PoolSizing};
pub use manager::{BlockTable, KvManager};
pub(crate) use pool::BlockPool;
/// The device K and V tensors (public with feature `testing`, for the device tests and
/// benchmarks that drive a model directly).
#[cfg(feature = "testing")]
pub use store::KvStore;
#[cfg(not(feature = "testing"))]
pub(crate) use store::KvStore;
