//! Ranks of one engine spread over several devices: the collectives they run between them
//! ([`Communicator`]), the in-process implementation the CPU tests run on ([`LocalGroup`]:
//! ranks as threads), and which share of each layer a tensor-parallel rank holds ([`TpRank`]).
//! NCCL is the device implementation of the same trait.

mod local;
#[cfg(feature = "cuda")]
mod nccl;
mod ranks;
mod shard;

pub use local::{LocalComm, LocalGroup};
pub(crate) use ranks::{OnReset, RankJob, Ranks, RanksPending};
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

    /// The logits of a vocabulary-parallel head: every rank's `local` `[rows, share]` (its
    /// vocabulary rows' logits, [`TpRank::vocab_share`]) side by side in rank order, trimmed to
    /// the first `vocab` columns (the shares' padding and any padded table rows). Every rank
    /// gets the whole `[rows, vocab]`, as from a whole head.
    pub(crate) fn gather_vocab(&self, local: &Tensor, vocab: usize) -> candle_core::Result<Tensor> {
        let last = local.rank().saturating_sub(1);
        let all = self.comm.all_gather(local, last).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if all.dim(last)? > vocab {
            return all.narrow(last, 0, vocab)?.contiguous();
        }
        Ok(all)
    }
}

/// The devices of `world` ranks from `first` on: the CPU for every rank on the CPU, the `world`
/// GPUs from `first`'s ordinal on CUDA.
pub fn rank_devices(first: &candle_core::Device, world: usize) -> Result<Vec<candle_core::Device>> {
    if world == 0 {
        return Err(crate::Error::InvalidOption("tensor_parallel must be >= 1".into()));
    }
    if world == 1 {
        return Ok(vec![first.clone()]);
    }
    match first.location() {
        candle_core::DeviceLocation::Cpu => Ok(vec![first.clone(); world]),
        candle_core::DeviceLocation::Cuda { gpu_id } => (gpu_id..gpu_id + world)
            .map(|o| {
                if o == gpu_id {
                    Ok(first.clone())
                } else {
                    candle_core::Device::new_cuda(o)
                        .map_err(|e| crate::Error::InvalidOption(format!("tensor parallelism over {world} GPUs from {gpu_id}: GPU {o}: {e}")))
                }
            })
            .collect(),
        other => Err(crate::Error::InvalidOption(format!("tensor parallelism is not supported on {other:?}"))),
    }
}

/// `devices` as the ranks' devices: at least one, and no GPU twice (NCCL joins one rank per
/// GPU).
pub fn check_rank_devices(devices: Vec<candle_core::Device>) -> Result<Vec<candle_core::Device>> {
    if devices.is_empty() {
        return Err(crate::Error::InvalidOption("tensor parallelism over no devices".into()));
    }
    let gpus: Vec<usize> = devices
        .iter()
        .filter_map(|d| match d.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
            _ => None,
        })
        .collect();
    let mut distinct = gpus.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != gpus.len() {
        return Err(crate::Error::InvalidOption(format!("tensor-parallel ranks on GPUs {gpus:?}: one rank a GPU")));
    }
    // (A mix of CPU and GPUs is refused where the group is made: `group`.)
    Ok(devices)
}

/// A communicator per rank for ranks on `devices` (none for one rank): threads of this process
/// on the CPU, NCCL on CUDA.
pub fn group(devices: &[candle_core::Device], timeout: std::time::Duration) -> Result<Vec<std::sync::Arc<dyn Communicator>>> {
    if devices.len() <= 1 {
        return Ok(Vec::new());
    }
    if devices.iter().all(|d| d.is_cpu()) {
        return Ok(LocalGroup::new(devices.len(), timeout)?.into_iter().map(|c| std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator>).collect());
    }
    #[cfg(feature = "cuda")]
    if devices.iter().all(|d| d.is_cuda()) {
        return nccl::NcclGroup::new(devices, timeout);
    }
    Err(crate::Error::InvalidOption("tensor-parallel ranks must all be on the CPU or all on CUDA GPUs".into()))
}

/// One model's shards, rank order, with each rank's communicator (none for a model on one
/// device).
pub(crate) struct Shards<M> {
    pub(crate) models: Vec<M>,
    pub(crate) comms: Vec<std::sync::Arc<dyn Communicator>>,
    /// How long a launch may run on the ranks before their group is aborted.
    pub(crate) timeout: std::time::Duration,
}

impl<M> Shards<M> {
    /// A whole model on one device.
    pub(crate) fn one(model: M) -> Self {
        Self { models: vec![model], comms: Vec::new(), timeout: std::time::Duration::MAX }
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

    /// Every rank's `t` (the same shape on every rank) concatenated along `dim` in rank order.
    /// Equal parts are what NCCL gathers; the callers' shares are equal by construction (a
    /// vocabulary padded to the ranks), and the NCCL group does not exchange shapes first,
    /// which would synchronise with the device inside a captured graph.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Rank r's `parts[j]` goes to rank j; the result's element j is what rank j sent to this
    /// rank (expert dispatch and combine). `parts` has one tensor per rank.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;

    /// Gives up: every rank's pending and later collectives fail with `reason` (the first
    /// reason given wins). A rank whose launch failed calls it so that the others stop instead
    /// of waiting for it. Returns whether this call was the one that stopped the group.
    fn abort(&self, reason: &str) -> bool;

    /// Whether the group has been aborted (and not reset since): a collective that seemed to
    /// complete meanwhile may have ended early.
    fn is_aborted(&self) -> bool;

    /// Makes a group that failed usable again. Called while no rank is inside a collective,
    /// once for the group (on any rank's communicator); calling it again is harmless.
    fn reset(&self);
}
