//! Reading a launch's small results back without stalling the device.
//!
//! candle's device-to-host copy waits for everything queued on the stream, so reading launch
//! N's sampled ids after launch N+1 was queued would wait for N+1 too. A [`Readback`] instead
//! queues an asynchronous copy into pinned host memory right behind launch N; the host waits
//! only for that copy when it needs the values, while the device goes on with N+1.

use candle_core::{Result, Tensor};

/// Element types a launch reads back (sampled ids, gate logits, latent changes).
#[cfg(feature = "cuda")]
pub trait Elem:
    candle_core::WithDType
    + candle_core::cuda_backend::CudaDType
    + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits
{
}
/// Element types a launch reads back (sampled ids, gate logits, latent changes).
#[cfg(not(feature = "cuda"))]
pub trait Elem: candle_core::WithDType {}
impl Elem for u32 {}
impl Elem for f32 {}

/// Host values of a device tensor, available once the copy queued behind its launch is done.
pub enum Readback<T> {
    /// Already on the host (CPU tensors).
    Host(Vec<T>),
    /// An asynchronous copy into pinned memory and an event recorded right behind it (CUDA).
    #[cfg(feature = "cuda")]
    Pinned(candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<T>, candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

impl<T: Elem> Readback<T> {
    /// Queues the copy of a tensor's elements (flattened, made contiguous first).
    pub fn start(t: &Tensor) -> Result<Self> {
        let t = t.flatten_all()?.contiguous()?;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = t.device() {
            use candle_core::cuda_backend::WrapErr;
            let (storage, layout) = t.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("readback: not a CUDA tensor") };
            let (start, end) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("readback: not contiguous".into()))?;
            let src = cs.as_cuda_slice::<T>()?.slice(start..end);
            let stream = dev.cuda_stream();
            // Flags 0: cached (not write-combined) pinned memory, since the host reads it.
            // SAFETY: the buffer is only read after the copy into it completed (`finish`).
            let mut dst = unsafe { stream.context().alloc_pinned_with_flags::<T>(end - start, 0) }.w()?;
            stream.memcpy_dtoh(&src, &mut dst).w()?;
            // Our own event: cudarc records the pinned slice's event only when it manages
            // several streams with event tracking on, so on our one stream (tracking off with
            // graphs) `as_slice` would not wait and could read the buffer before the copy lands.
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let done = stream.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).w()?;
            return Ok(Self::Pinned(dst, done));
        }
        Ok(Self::Host(t.to_vec1::<T>()?))
    }

    /// Waits for the copy (only it) and returns the values.
    pub fn finish(self) -> Result<Vec<T>> {
        match self {
            Self::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Self::Pinned(p, done) => {
                use candle_core::cuda_backend::WrapErr;
                done.synchronize().w()?;
                Ok(p.as_slice().w()?.to_vec())
            }
        }
    }
}
