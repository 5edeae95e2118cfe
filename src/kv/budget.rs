//! Whether a KV pool fits the memory of its device, checked before it is allocated: a pool
//! too large for the device (an absurd config, a capacity set by hand) must be a typed error,
//! not an allocation failure that aborts the process.

use crate::{Error, Result};
use candle_core::{DType, Device};

/// Bytes of a KV pool: K and V for `tokens` positions in each of `layers` layers.
pub fn kv_bytes(tokens: usize, layers: usize, kv_heads: usize, head_dim: usize, dtype: DType) -> Option<u64> {
    [tokens, layers, kv_heads, head_dim, 2, dtype.size_in_bytes()].iter().try_fold(1u64, |acc, &x| acc.checked_mul(x as u64))
}

/// What an engine needs of its device's memory: the KV pool and the looped scheduler's state
/// bank, allocated at build, and one launch's activations, allocated while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeed {
    /// Bytes of the KV pool; `None` where their count overflows 64 bits.
    pub pool: Option<u64>,
    /// Bytes of the state bank (0 without one).
    pub bank: u64,
    /// Bytes one launch may take besides weights and KV ([`workspace_bytes`]).
    pub workspace: u64,
}

impl MemoryNeed {
    /// Everything together (saturating: a workspace or bank that saturates still compares as
    /// far more than any device has); `None` where the pool's own size overflows.
    fn total(&self) -> Option<u64> {
        Some(self.pool?.saturating_add(self.bank).saturating_add(self.workspace))
    }

    fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / GIB;
        let mut parts = vec![format!("the KV pool ({:.2} GiB)", gib(self.pool.unwrap_or(u64::MAX)))];
        if self.bank > 0 {
            parts.push(format!("the state bank ({:.2} GiB)", gib(self.bank)));
        }
        parts.push(format!("a launch's workspace ({:.2} GiB)", gib(self.workspace)));
        let last = parts.pop().expect("two parts at least");
        format!("{} and {last}", parts.join(", "))
    }
}

/// Refuses an engine whose [`MemoryNeed`] exceeds the memory `device` has free now (CPU:
/// `MemAvailable` of /proc/meminfo; CUDA: the driver's free memory), before anything is
/// allocated: a pool that leaves no room for the launches would fail every request at its first
/// large launch instead. `hint` says which option to lower. Where the figure cannot be read,
/// nothing is refused.
pub fn check_fits(need: MemoryNeed, hint: &str, device: &Device) -> Result<()> {
    let Some(needed) = need.total() else {
        return Err(Error::InvalidOption(format!("the size of the KV pool overflows 64 bits; {hint}")));
    };
    match available(device) {
        Some(free) if needed > free => {
            Err(Error::DeviceMemory { what: need.describe(), needed, available: free, device: device_name(device), hint: hint.to_string() })
        }
        _ => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// `cuda:N` (the device's ordinal) or `cpu`, for messages.
fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        other => format!("{other:?}"),
    }
}

/// Fraction of the free device memory the KV pool takes by default on CUDA (after the weights
/// are loaded and the workspace estimate is set aside), like vLLM's `gpu_memory_utilization`.
pub const DEFAULT_KV_MEMORY_FRACTION: f64 = 0.9;

/// Pool positions per KV slot on the CPU (and wherever free memory cannot be read) when no size
/// is given.
pub const DEFAULT_CPU_POOL_TOKENS_PER_SLOT: usize = 16_384;

/// Memory one launch's activations may take besides weights and KV: `launch_tokens` positions of
/// ~32 f32 vectors of `hidden` (residual, norms, q/k/v, the MLP's gate/up, temporaries), f32
/// logits and their softmax for `readout_rows`, and on CUDA 1 GiB for the BLAS workspace, CUDA
/// graphs and the allocator's slack. An estimate on the safe side for the families we serve.
pub fn workspace_bytes(launch_tokens: usize, hidden: usize, readout_rows: usize, vocab: usize, device: &Device) -> u64 {
    let activations = (launch_tokens as u64).saturating_mul(hidden as u64).saturating_mul(32 * 4);
    let logits = (readout_rows as u64).saturating_mul(vocab as u64).saturating_mul(2 * 4);
    let cuda_slack = if device.is_cuda() { 1 << 30 } else { 0 };
    activations.saturating_add(logits).saturating_add(cuda_slack)
}

/// How the KV pool is sized: the pool positions (across every slot) and the bytes they take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolSizing {
    /// Explicit positions across all slots (`kv_capacity_tokens`): wins over the fraction.
    pub tokens: Option<usize>,
    /// Fraction of the device's free memory (`kv_memory_fraction`); CUDA defaults to
    /// [`DEFAULT_KV_MEMORY_FRACTION`], the CPU to a fixed size.
    pub fraction: Option<f64>,
}

impl PoolSizing {
    /// Pool positions across `slots` slots at `bytes_per_position` (one position of one slot, all
    /// layers): explicit, or the chosen fraction of free memory less `reserved` (a launch's
    /// workspace and the state bank), capped at `useful` (what the resident requests could ever
    /// fill). Errors when the memory left over cannot hold a single position per slot.
    pub fn pool_tokens(&self, device: &Device, slots: usize, bytes_per_position: u64, reserved: u64, useful: usize) -> Result<usize> {
        if let Some(n) = self.tokens {
            return Ok(n);
        }
        let fraction = self.fraction.or(device.is_cuda().then_some(DEFAULT_KV_MEMORY_FRACTION));
        let fallback = DEFAULT_CPU_POOL_TOKENS_PER_SLOT.saturating_mul(slots);
        let (Some(fraction), Some(free)) = (fraction, fraction.and_then(|_| available(device))) else {
            return Ok(fallback);
        };
        let budget = (free as f64 * fraction) as u64;
        let for_kv = budget.saturating_sub(reserved);
        let tokens = usize::try_from(for_kv / bytes_per_position.max(1)).unwrap_or(usize::MAX);
        if tokens < slots.max(1) {
            return Err(Error::InvalidOption(format!(
                "{:.0} % of the {:.2} GiB free on {} leaves no room for a KV pool after {:.2} GiB for a launch's workspace and the state bank; raise kv_memory_fraction, lower max_num_batched_tokens / max_num_seqs, or set kv_capacity_tokens",
                fraction * 100.0,
                free as f64 / GIB,
                device_name(device),
                reserved as f64 / GIB
            )));
        }
        Ok(tokens.min(useful.max(slots)))
    }
}

fn available(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            // Memory freed by work still queued (an engine dropped just before) returns to the
            // driver only once the stream has caught up.
            device.synchronize().ok()?;
            d.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64)
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_sized_explicitly_by_fraction_or_by_the_cpu_default() {
        let explicit = PoolSizing { tokens: Some(100), fraction: Some(0.5) };
        assert_eq!(explicit.pool_tokens(&Device::Cpu, 4, 1024, 0, usize::MAX).unwrap(), 100, "an explicit count wins");
        let default = PoolSizing { tokens: None, fraction: None };
        assert_eq!(default.pool_tokens(&Device::Cpu, 4, 1024, 0, usize::MAX).unwrap(), 4 * DEFAULT_CPU_POOL_TOKENS_PER_SLOT);
        let free = available(&Device::Cpu).expect("this test reads /proc/meminfo");
        let tenth = PoolSizing { tokens: None, fraction: Some(0.1) };
        let per_position = 1 << 20;
        let got = tenth.pool_tokens(&Device::Cpu, 1, per_position, 0, usize::MAX).unwrap() as u64;
        // Free memory moves a little between the two reads.
        let want = free / 10 / per_position;
        assert!(got.abs_diff(want) <= want / 20 + 2, "{got} positions for a tenth of {free} bytes, expected ~{want}");
        assert_eq!(tenth.pool_tokens(&Device::Cpu, 1, per_position, 0, 7).unwrap(), 7, "capped at what requests can use");
        let err = tenth.pool_tokens(&Device::Cpu, 1, per_position, u64::MAX, usize::MAX);
        assert!(matches!(err, Err(Error::InvalidOption(m)) if m.contains("no room")), "a workspace larger than memory is an error");
        assert!(workspace_bytes(8192, 2048, 64, 49152, &Device::Cpu) > workspace_bytes(16, 2048, 64, 49152, &Device::Cpu));
    }

    #[test]
    fn absurd_pools_are_refused_and_small_ones_pass() {
        assert_eq!(kv_bytes(16, 2, 4, 8, DType::F32), Some(16 * 2 * 4 * 8 * 2 * 4));
        let need = |pool: Option<u64>, workspace: u64| MemoryNeed { pool, bank: 1 << 20, workspace };
        assert!(check_fits(need(kv_bytes(1 << 12, 4, 2, 32, DType::F32), 1 << 20), "", &Device::Cpu).is_ok());
        // 4 TB: no machine this runs on has it available.
        let err = check_fits(need(kv_bytes(1 << 30, 64, 16, 128, DType::F32), 0), "lower it", &Device::Cpu).unwrap_err();
        assert!(matches!(&err, Error::DeviceMemory { needed, available, .. } if needed > available), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("the KV pool (1048576.00 GiB), the state bank (0.00 GiB) and a launch's workspace (0.00 GiB) need") && text.ends_with("lower it"),
            "{text}"
        );
        // A pool that fits alone but not with the workspace a launch needs is refused too.
        let free = available(&Device::Cpu).expect("this test reads /proc/meminfo");
        assert!(check_fits(need(Some(free / 2), 0), "", &Device::Cpu).is_ok());
        assert!(matches!(check_fits(need(Some(free / 2), free), "", &Device::Cpu), Err(Error::DeviceMemory { .. })));
        assert!(
            matches!(check_fits(need(kv_bytes(usize::MAX, 2, 2, 2, DType::F32), 0), "", &Device::Cpu), Err(Error::InvalidOption(_))),
            "an overflowing pool"
        );
        let saturated = check_fits(need(Some(1 << 20), u64::MAX), "", &Device::Cpu);
        assert!(matches!(saturated, Err(Error::DeviceMemory { .. })), "a saturated workspace is too much memory, not an overflowing pool: {saturated:?}");
    }
}
