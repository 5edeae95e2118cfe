//! Peak device memory of a stretch of work, for benchmark reports (CUDA).
//!
//! candle allocates through the driver's stream-ordered allocator, so every tensor — weights, the
//! KV store, the state bank, activations — comes from the device's default memory pool, whose
//! driver-kept high-water mark of memory in use is exact; CUDA graphs allocate from graph memory,
//! which has its own mark. [`reset_peak`] starts a measurement, [`peak`] reads it. Memory held
//! outside both (cuBLAS workspaces, the CUDA context itself) is not counted.

use candle_core::{Device, Result};

/// High-water marks since the last [`reset_peak`], in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeakMemory {
    /// Stream-ordered allocations in use (the device's default memory pool).
    pub pool_bytes: u64,
    /// Memory in use by CUDA graphs' own allocations.
    pub graph_bytes: u64,
}

impl PeakMemory {
    /// Both marks added: an upper bound of the peak (the two need not peak together).
    pub fn total_bytes(&self) -> u64 {
        self.pool_bytes + self.graph_bytes
    }

    /// `{"peak_device_memory_gb", …_pool_gb, …_graphs_gb}` fields for a benchmark row (all
    /// `null` for `None`).
    pub fn json_fields(peak: Option<Self>) -> [(&'static str, Option<f64>); 3] {
        let gb = |f: fn(&Self) -> u64| peak.map(|p| f(&p) as f64 / 1e9);
        [
            ("peak_device_memory_gb", gb(Self::total_bytes)),
            ("peak_device_memory_pool_gb", gb(|p| p.pool_bytes)),
            ("peak_device_memory_graphs_gb", gb(|p| p.graph_bytes)),
        ]
    }
}

impl std::fmt::Display for PeakMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        write!(f, "{:.1} GB (pool {:.1} + graphs {:.1})", gb(self.total_bytes()), gb(self.pool_bytes), gb(self.graph_bytes))
    }
}

/// Starts a new measurement on `device` (a no-op off CUDA).
pub fn reset_peak(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return cuda::reset(dev);
    }
    let _ = device;
    Ok(())
}

/// The marks since the last [`reset_peak`] (`None` off CUDA).
pub fn peak(device: &Device) -> Result<Option<PeakMemory>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return cuda::read(dev).map(Some);
    }
    let _ = device;
    Ok(None)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::PeakMemory;
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaDevice, Result};

    fn pool_and_device(dev: &CudaDevice) -> Result<(sys::CUmemoryPool, sys::CUdevice)> {
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        let cu_dev = ctx.cu_device();
        // SAFETY: `cu_dev` is the context's own device handle.
        let pool = unsafe { candle_core::cuda_backend::cudarc::driver::result::device::get_default_mem_pool(cu_dev) }.w()?;
        Ok((pool, cu_dev))
    }

    pub(super) fn reset(dev: &CudaDevice) -> Result<()> {
        let (pool, cu_dev) = pool_and_device(dev)?;
        // High-water marks can only be reset to zero; the driver then tracks from current use.
        let mut zero = 0u64;
        // SAFETY: both attributes take a `u64` (cuuint64_t) value.
        unsafe {
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, (&mut zero as *mut u64).cast()).result().w()?;
            sys::cuDeviceSetGraphMemAttribute(cu_dev, sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, (&mut zero as *mut u64).cast())
                .result()
                .w()?;
        }
        Ok(())
    }

    pub(super) fn read(dev: &CudaDevice) -> Result<PeakMemory> {
        let (pool, cu_dev) = pool_and_device(dev)?;
        let (mut pool_bytes, mut graph_bytes) = (0u64, 0u64);
        // SAFETY: both attributes write a `u64` (cuuint64_t).
        unsafe {
            sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, (&mut pool_bytes as *mut u64).cast()).result().w()?;
            sys::cuDeviceGetGraphMemAttribute(cu_dev, sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, (&mut graph_bytes as *mut u64).cast())
                .result()
                .w()?;
        }
        Ok(PeakMemory { pool_bytes, graph_bytes })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn off_cuda_there_is_nothing_to_measure() {
        let cpu = candle_core::Device::Cpu;
        super::reset_peak(&cpu).unwrap();
        assert_eq!(super::peak(&cpu).unwrap(), None);
        assert!(super::PeakMemory::json_fields(None).iter().all(|(_, v)| v.is_none()));
    }

    #[test]
    fn reports_in_gigabytes() {
        let p = super::PeakMemory { pool_bytes: 11_000_000_000, graph_bytes: 1_300_000_000 };
        assert_eq!(p.to_string(), "12.3 GB (pool 11.0 + graphs 1.3)");
        let fields = super::PeakMemory::json_fields(Some(p));
        assert_eq!(fields[0], ("peak_device_memory_gb", Some(12.3)));
        assert_eq!(fields[2], ("peak_device_memory_graphs_gb", Some(1.3)));
    }
}
