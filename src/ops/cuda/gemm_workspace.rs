//! cuBLAS's workspace while a CUDA graph is captured.
//!
//! Where no workspace is set on a handle, cuBLAS (CUDA 12.2 and later) takes the memory an
//! algorithm needs with `cudaMallocAsync` on the calling stream and frees it after the call. Under
//! stream capture that is an alloc node and a free node in the graph for every such product:
//! Huginn-0125's decode projections at 16 rows (the MLP's 17 920-deep one, the 10 560-deep
//! adapter) pick split-k algorithms that need one, so its arena graphs held memory nodes though
//! every buffer of ours was preallocated. A buffer set on the handle for the capture takes their
//! place; the graphs captured with it keep it alive.

use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Result};

/// What cuBLAS recommends for Hopper (and more than its algorithms ask for elsewhere).
pub const GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// A device buffer that cuBLAS uses, in place of allocating, while a graph is captured.
pub struct GemmWorkspace {
    buf: CudaSlice<u8>,
}

impl std::fmt::Debug for GemmWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GemmWorkspace({} bytes)", self.buf.len())
    }
}

impl GemmWorkspace {
    /// Allocates the buffer on `device` (outside any capture).
    pub fn new(device: &Device) -> Result<Self> {
        let dev = cuda(device)?;
        // SAFETY: cuBLAS uses the workspace as scratch; nothing reads it before writing.
        let buf = unsafe { dev.alloc::<u8>(GEMM_WORKSPACE_BYTES)? };
        Ok(Self { buf })
    }

    /// Runs `body` with cuBLAS on `device`'s handle using this buffer as its workspace; after it,
    /// returned, failed or unwound, the handle uses its default pool again (`cublasSetStream`
    /// resets the workspace), so eager products never touch a buffer a graph may be replaying
    /// with. Lends are serialised process-wide: candle's handle is the device's, shared by its
    /// clones, and a second lend on it must not replace the first's buffer mid-capture. (Another
    /// thread's eager products on a clone of the same device during the capture would be
    /// captured anyway — a capture owns its stream — so the engine never shares one.)
    pub fn lend<R>(&self, device: &Device, body: impl FnOnce() -> Result<R>) -> Result<R> {
        static LENDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one_at_a_time = LENDING.lock().unwrap_or_else(|e| e.into_inner());
        let dev = cuda(device)?;
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let handle = *blas.handle();
        {
            let (ptr, _guard) = self.buf.device_ptr(&stream);
            // SAFETY: a live buffer of this length on the handle's device; the caller keeps it
            // alive for as long as anything captured with it can run (the graphs hold it).
            let status = unsafe { sys::cublasSetWorkspace_v2(handle, ptr as *mut std::ffi::c_void, self.buf.len()) };
            check(status, "cublasSetWorkspace")?;
        }
        let reset = Reset { handle, stream: stream.cu_stream() as _ };
        let out = body();
        let reset = reset.now();
        let out = out?;
        reset?;
        Ok(out)
    }
}

/// Gives a handle its default workspace pool back when dropped (a `body` that unwinds too).
struct Reset {
    handle: sys::cublasHandle_t,
    stream: sys::cudaStream_t,
}

impl Reset {
    fn now(self) -> Result<()> {
        let r = self.reset();
        std::mem::forget(self);
        r
    }

    fn reset(&self) -> Result<()> {
        // SAFETY: the handle's own stream, set again; this only resets its workspace.
        check(unsafe { sys::cublasSetStream_v2(self.handle, self.stream) }, "cublasSetStream")
    }
}

impl Drop for Reset {
    fn drop(&mut self) {
        let _ = self.reset();
    }
}

fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(dev) => Ok(dev),
        _ => candle_core::bail!("cuBLAS workspace on {device:?}"),
    }
}

fn check(status: sys::cublasStatus_t, call: &str) -> Result<()> {
    match status {
        sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        s => candle_core::bail!("{call}: {s:?}"),
    }
}
