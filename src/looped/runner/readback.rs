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

/// Pinned host buffers (each with the event that marks its copy done) kept between launches.
///
/// Allocating and freeing page-locked memory costs tens of microseconds per call, and freeing
/// it may wait for the device; a decode step reads back up to three small arrays, so the runner
/// keeps its buffers and reuses them. A buffer returns here once its values have been read.
#[derive(Default)]
pub struct ReadbackPool<T> {
    #[cfg(feature = "cuda")]
    free: std::cell::RefCell<Vec<PinnedBuffer<T>>>,
    #[cfg(not(feature = "cuda"))]
    _elem: std::marker::PhantomData<T>,
}

#[cfg(feature = "cuda")]
type PinnedBuffer<T> = (candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<T>, candle_core::cuda_backend::cudarc::driver::CudaEvent);

/// Buffers kept at most (two launches in flight read back three arrays each).
#[cfg(feature = "cuda")]
const POOL_KEEP: usize = 8;

#[cfg(feature = "cuda")]
impl<T: Elem> ReadbackPool<T> {
    /// A free buffer of at least `len` elements (the smallest that fits), or a new one.
    fn take(&self, dev: &candle_core::CudaDevice, len: usize) -> Result<PinnedBuffer<T>> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        use candle_core::cuda_backend::WrapErr;
        let mut free = self.free.borrow_mut();
        let fit = free.iter().enumerate().filter(|(_, (b, _))| b.len() >= len).min_by_key(|(_, (b, _))| b.len()).map(|(i, _)| i);
        if let Some(i) = fit {
            return Ok(free.swap_remove(i));
        }
        let ctx = dev.cuda_stream().context().clone();
        // Rounded up so that a launch a few rows wider reuses the buffer.
        let capacity = len.next_power_of_two().max(256);
        // Flags 0: cached (not write-combined) pinned memory, since the host reads it.
        // SAFETY: the buffer is only read after a copy into it completed (`finish`).
        let buf = unsafe { ctx.alloc_pinned_with_flags::<T>(capacity, 0) }.w()?;
        let done = ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).w()?;
        Ok((buf, done))
    }

    fn give_back(&self, buffer: PinnedBuffer<T>) {
        let mut free = self.free.borrow_mut();
        if free.len() < POOL_KEEP {
            free.push(buffer);
        }
    }
}

/// Host values of a device tensor, available once the copy queued behind its launch is done.
pub enum Readback<T> {
    /// Already on the host (CPU tensors).
    Host(Vec<T>),
    /// An asynchronous copy of `len` elements into a pooled pinned buffer, and the buffer's event
    /// recorded right behind it (CUDA).
    #[cfg(feature = "cuda")]
    Pinned { buffer: PinnedBuffer<T>, len: usize },
}

impl<T: Elem> Readback<T> {
    /// Queues the copy of a tensor's elements (flattened, made contiguous first) into a buffer
    /// from `pool`.
    pub fn start(t: &Tensor, pool: &ReadbackPool<T>) -> Result<Self> {
        let t = t.flatten_all()?.contiguous()?;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = t.device() {
            use candle_core::cuda_backend::WrapErr;
            let (storage, layout) = t.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("readback: not a CUDA tensor") };
            let (start, end) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("readback: not contiguous".into()))?;
            let src = cs.as_cuda_slice::<T>()?.slice(start..end);
            let stream = dev.cuda_stream();
            let len = end - start;
            let (mut dst, done) = pool.take(dev, len)?;
            // `CudaStream::memcpy_dtoh` copies as many bytes as the destination holds, and a
            // pooled buffer may be longer than the source: copy exactly `len` elements.
            {
                use candle_core::cuda_backend::cudarc::driver::{result, DevicePtr};
                let (src_ptr, _src_guard) = src.device_ptr(&stream);
                // SAFETY: `dst` holds at least `len` elements (`take`) and is neither read nor
                // reused until `done`, recorded right behind this copy, has completed.
                let host = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().w()?, len) };
                unsafe { result::memcpy_dtoh_async(host, src_ptr, stream.cu_stream()) }.w()?;
            }
            // The pinned slice's own event is recorded only when cudarc tracks events across
            // streams (off here), so the copy is ordered on our one stream and `done` marks it.
            done.record(&stream).w()?;
            return Ok(Self::Pinned { buffer: (dst, done), len });
        }
        #[cfg(not(feature = "cuda"))]
        let _ = pool;
        Ok(Self::Host(t.to_vec1::<T>()?))
    }

    /// Waits for the copy (only it), returns the values and the buffer to `pool`.
    pub fn finish(self, pool: &ReadbackPool<T>) -> Result<Vec<T>> {
        #[cfg(not(feature = "cuda"))]
        let _ = pool;
        match self {
            Self::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Self::Pinned { buffer, len } => {
                use candle_core::cuda_backend::WrapErr;
                buffer.1.synchronize().w()?;
                let values = buffer.0.as_slice().w()?[..len].to_vec();
                pool.give_back(buffer);
                Ok(values)
            }
        }
    }
}
