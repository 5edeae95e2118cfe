//! What every kernel launch of ours shares: the device of an input, checked contiguous views of
//! tensor storage, wrapping an output buffer as a tensor, loading a kernel from one of our PTX
//! modules, and the dispatch on the float dtype (`for_float!`).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ponder_kernels.rs"));
}

/// Runs `$body` with `$T` the element type and `$suf` the kernel-name suffix of the float dtype
/// `$dtype` (bf16, f16, f32); any other dtype is an error of `$op`.
macro_rules! for_float {
    ($dtype:expr, $op:expr, |$T:ident, $suf:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                let $suf = "bf16";
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                let $suf = "f16";
                $body
            }
            candle_core::DType::F32 => {
                type $T = f32;
                let $suf = "f32";
                $body
            }
            d => candle_core::bail!("{} (cuda): dtype {d:?} not supported", $op),
        }
    };
}
pub(super) use for_float;

/// Our PTX modules (built from `src/ops/kernels/*.cu` by `build.rs`).
#[derive(Debug, Clone, Copy)]
pub(super) enum Module {
    PagedAttention,
    Fused,
    Focus,
    Moe,
}

impl Module {
    /// The module's name and PTX.
    pub(super) fn ptx(self) -> (&'static str, &'static str) {
        match self {
            Self::PagedAttention => ("ponder_paged_attention", ptx::PAGED_ATTENTION),
            Self::Fused => ("ponder_fused", ptx::FUSED),
            Self::Focus => ("ponder_focus", ptx::FOCUS),
            Self::Moe => ("ponder_moe", ptx::MOE),
        }
    }
}

/// `kernel!(dev, module, name)`: kernel `name` of our PTX `module`, loaded once per device by
/// candle (a macro: candle does not name the type it returns).
macro_rules! kernel {
    ($dev:expr, $module:expr, $name:expr) => {{
        let (module, ptx) = $module.ptx();
        $dev.get_or_load_custom_func($name, module, ptx)
    }};
}
pub(super) use kernel;

/// The CUDA device `t` lives on.
pub(super) fn device(t: &Tensor, op: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        d => bail!("{op} (cuda): input is on {d:?}"),
    }
}

/// A contiguous view of a tensor's storage at its layout, checked for dtype and, with
/// `align16`, for the 16-byte alignment vector loads need.
pub(super) fn view<'a, T: CudaDType + DeviceRepr>(storage: &'a Storage, layout: &Layout, op: &str, name: &str, align16: bool) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = storage else {
        bail!("{op} (cuda): {name} is not a CUDA tensor");
    };
    if !layout.is_contiguous() {
        bail!("{op} (cuda): {name} must be contiguous");
    }
    let start = layout.start_offset();
    if align16 && (start * std::mem::size_of::<T>()) % 16 != 0 {
        bail!("{op} (cuda): {name} starts at element {start}, not 16-byte aligned");
    }
    let slice = cs.as_cuda_slice::<T>()?;
    Ok(slice.slice(start..start + layout.shape().elem_count()))
}

/// A kernel's output buffer as a tensor of `shape`.
pub(super) fn wrap<T: CudaDType + DeviceRepr, S: Into<candle_core::Shape>>(out: CudaSlice<T>, dev: &CudaDevice, shape: S) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Every tensor of `ts` is on `first`'s device and of `dtype`.
pub(super) fn same_device_dtype(op: &str, dtype: DType, first: &Tensor, ts: &[(&str, &Tensor)]) -> Result<()> {
    for (name, t) in ts {
        if !t.device().same_device(first.device()) {
            bail!("{op} (cuda): {name} is on {:?}, not {:?}", t.device(), first.device());
        }
        if t.dtype() != dtype {
            bail!("{op} (cuda): {name} is {:?}, expected {dtype:?}", t.dtype());
        }
    }
    Ok(())
}

/// The default of [`l2_prefetch_limit`]: about half of Hopper's 50 MB L2, so a prefetched
/// matrix and the one being read fit together.
const L2_PREFETCH_DEFAULT_MB: u64 = 24;

/// The most bytes of a weight matrix a fused kernel prefetches into L2 for the matmul after it:
/// `PONDER_L2_PREFETCH_MB` (0 turns prefetching off), read once per process.
pub(crate) fn l2_prefetch_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mb = std::env::var("PONDER_L2_PREFETCH_MB").ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(L2_PREFETCH_DEFAULT_MB);
        mb << 20
    })
}

/// The kernel arguments `(pf, pf_bytes)` for prefetching `next` (the weights the following
/// matmul reads) into L2: its device address and the first [`l2_prefetch_limit`] bytes of it,
/// rounded down to 16. `(0, 0)` — no prefetch — without weights, for a tensor on another device
/// or of a dtype the models do not run in, or when the start is not 16-byte aligned.
pub(super) fn l2_prefetch_args(dev: &CudaDevice, next: Option<&Tensor>) -> Result<(u64, u64)> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let Some(t) = next else { return Ok((0, 0)) };
    let limit = l2_prefetch_limit();
    if limit == 0 || !t.device().same_device(&candle_core::Device::Cuda(dev.clone())) || !t.is_contiguous() {
        return Ok((0, 0));
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { return Ok((0, 0)) };
    let stream = dev.cuda_stream();
    let (start, len) = (layout.start_offset(), layout.shape().elem_count());
    // The address only: the kernel reads nothing through it, so no event tracking is needed.
    let base = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.slice(start..start + len).device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>()?.slice(start..start + len).device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.slice(start..start + len).device_ptr(&stream).0,
        _ => return Ok((0, 0)),
    };
    if base % 16 != 0 {
        return Ok((0, 0));
    }
    let bytes = ((len * t.dtype().size_in_bytes()) as u64).min(limit) & !15;
    Ok((base, bytes))
}
