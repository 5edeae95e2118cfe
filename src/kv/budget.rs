//! Whether a KV pool fits the memory of its device, checked before it is allocated: a pool
//! too large for the device (an absurd config, a capacity set by hand) must be a typed error,
//! not an allocation failure that aborts the process.

use crate::{Error, Result};
use candle_core::{DType, Device};

/// Bytes of a KV pool: K and V for `tokens` positions in each of `layers` layers.
pub fn kv_bytes(tokens: usize, layers: usize, kv_heads: usize, head_dim: usize, dtype: DType) -> Option<u64> {
    [tokens, layers, kv_heads, head_dim, 2, dtype.size_in_bytes()].iter().try_fold(1u64, |acc, &x| acc.checked_mul(x as u64))
}

/// Refuses a KV pool of `bytes` that exceeds the memory `device` has available now (CPU:
/// `MemAvailable` of /proc/meminfo; CUDA: the driver's free memory). Where the figure cannot be
/// read, nothing is refused.
pub fn check_fits(bytes: Option<u64>, device: &Device) -> Result<()> {
    let Some(bytes) = bytes else {
        return Err(Error::InvalidOption("the KV pool's size overflows 64 bits".into()));
    };
    match available(device) {
        Some(free) if bytes > free => Err(Error::InvalidOption(format!(
            "a KV pool of {:.2} GiB does not fit the {:.2} GiB available on {device:?}; lower kv_capacity_tokens or max_model_len",
            bytes as f64 / GIB,
            free as f64 / GIB
        ))),
        _ => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn available(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_pools_are_refused_and_small_ones_pass() {
        assert_eq!(kv_bytes(16, 2, 4, 8, DType::F32), Some(16 * 2 * 4 * 8 * 2 * 4));
        assert!(check_fits(kv_bytes(1 << 12, 4, 2, 32, DType::F32), &Device::Cpu).is_ok());
        // 4 TB: no machine this runs on has it available.
        assert!(matches!(check_fits(kv_bytes(1 << 30, 64, 16, 128, DType::F32), &Device::Cpu), Err(Error::InvalidOption(m)) if m.contains("does not fit")));
        assert!(check_fits(kv_bytes(usize::MAX, 2, 2, 2, DType::F32), &Device::Cpu).is_err(), "overflow is refused too");
    }
}
