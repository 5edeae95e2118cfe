//! Ranks of one engine spread over several devices: the collectives they run between them
//! ([`Communicator`]), the in-process implementation the CPU tests run on ([`LocalGroup`]:
//! ranks as threads), and which share of each layer a tensor-parallel rank holds ([`TpRank`]).
//! NCCL is the device implementation of the same trait.

mod local;
mod shard;

pub use local::{LocalComm, LocalGroup};
pub use shard::TpRank;

use crate::Result;
use candle_core::Tensor;

/// What a model shard holds of its group: its place and the collectives it sums its
/// row-parallel outputs with.
#[derive(Clone)]
pub(crate) struct TpShard {
    pub(crate) rank: TpRank,
    comm: std::sync::Arc<dyn Communicator>,
}

impl std::fmt::Debug for TpShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpShard({:?})", self.rank)
    }
}

impl TpShard {
    /// `rank` over `comm`, which must be that rank of a group of that size.
    pub(crate) fn new(rank: TpRank, comm: std::sync::Arc<dyn Communicator>) -> Result<Self> {
        if comm.world_size() != rank.world || comm.rank() != rank.rank {
            return Err(crate::Error::InvalidOption(format!("rank {rank:?} with a communicator of rank {} of {}", comm.rank(), comm.world_size())));
        }
        Ok(Self { rank, comm })
    }

    /// The sum of every rank's `x` (a row-parallel layer's partial outputs), as a model's ops
    /// return errors.
    pub(crate) fn sum(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.comm.all_reduce_sum(x).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// The collectives of one rank in a group of `world_size()` ranks. Every rank of the group calls
/// the same collectives in the same order; each call returns when every rank has contributed,
/// with an [`crate::Error::Collective`] on every rank if one gave up or did not come in time.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// The element-wise sum of every rank's `t` (same shape and dtype on every rank), summed in
    /// rank order so that every rank holds bit-identical results.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;

    /// Every rank's `t` concatenated along `dim` in rank order (shapes may differ along `dim`).
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Rank r's `parts[j]` goes to rank j; the result's element j is what rank j sent to this
    /// rank (expert dispatch and combine). `parts` has one tensor per rank.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;

    /// Gives up: every rank's pending and later collectives fail with `reason`. A rank whose
    /// launch failed calls it so that the others stop instead of waiting for it.
    fn abort(&self, reason: &str);
}
