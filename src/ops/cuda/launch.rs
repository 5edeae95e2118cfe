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
    Fp8,
}

impl Module {
    /// The module's name and PTX.
    pub(super) fn ptx(self) -> (&'static str, &'static str) {
        match self {
            Self::PagedAttention => ("ponder_paged_attention", ptx::PAGED_ATTENTION),
            Self::Fused => ("ponder_fused", ptx::FUSED),
            Self::Focus => ("ponder_focus", ptx::FOCUS),
            Self::Moe => ("ponder_moe", ptx::MOE),
            Self::Fp8 => ("ponder_fp8", ptx::FP8),
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

/// Device attribute `attr` of `dev`, asked of the driver once per device ordinal and attribute:
/// the SM count and compute capability are read for every attention, MoE or split-K launch.
fn device_attribute(dev: &CudaDevice, attr: candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute) -> Result<i32> {
    use candle_core::cuda_backend::WrapErr;
    type Known = Vec<(usize, u32, i32)>;
    static KNOWN: std::sync::Mutex<Known> = std::sync::Mutex::new(Vec::new());
    let ctx = dev.cuda_stream().context().clone();
    let key = (ctx.ordinal(), attr as u32);
    let known = |k: &Known| k.iter().find(|&&(o, a, _)| (o, a) == key).map(|&(_, _, v)| v);
    if let Some(v) = known(&KNOWN.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(v);
    }
    let v = ctx.attribute(attr).w()?;
    KNOWN.lock().unwrap_or_else(|e| e.into_inner()).push((key.0, key.1, v));
    Ok(v)
}

/// Blocks of kernel `name` (of `threads` threads and `smem` bytes of dynamic shared memory) that
/// `dev` runs at once: SMs × `per_sm()` (the occupancy calculator's blocks an SM, asked the first
/// time only), cached per device and kernel.
pub(super) fn resident_blocks(dev: &CudaDevice, name: &str, (threads, smem): (usize, usize), per_sm: impl FnOnce() -> Result<usize>) -> Result<usize> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Key = (candle_core::cuda_backend::DeviceId, String, usize, usize);
    static CACHE: OnceLock<Mutex<HashMap<Key, usize>>> = OnceLock::new();
    let key = (dev.id(), name.to_string(), threads, smem);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(&b) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(b);
    }
    let blocks = (sm_count(dev)? * per_sm()?).max(1);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, blocks);
    Ok(blocks)
}

/// The device's SM count (at least 1).
pub fn sm_count(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    Ok(device_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize)
}

/// Blocks for a grid-stride kernel that covers `needed` blocks' worth of work: all of them, up to
/// 16 an SM (more only repeat the loop's bookkeeping), at least one.
pub(super) fn grid_stride_blocks(dev: &CudaDevice, needed: usize) -> Result<u32> {
    let most = (sm_count(dev)? * 16).min(u32::MAX as usize);
    Ok(needed.clamp(1, most) as u32)
}

/// The device's compute capability major version (Hopper paths: the MoE GEMM, decode attention's
/// bulk-copy ring).
pub fn compute_major(dev: &CudaDevice) -> Result<i32> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    device_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
}

/// The device's compute capability, (major, minor).
pub fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    Ok((compute_major(dev)?, device_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?))
}

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

/// Every tensor of `ts` is on `first`'s device.
pub(super) fn same_device(op: &str, first: &Tensor, ts: &[(&str, &Tensor)]) -> Result<()> {
    if let Some((name, t)) = ts.iter().find(|(_, t)| !t.device().same_device(first.device())) {
        bail!("{op} (cuda): {name} is on {:?}, not {:?}", t.device(), first.device());
    }
    Ok(())
}

/// Every tensor of `ts` is on `first`'s device and of `dtype`.
pub(super) fn same_device_dtype(op: &str, dtype: DType, first: &Tensor, ts: &[(&str, &Tensor)]) -> Result<()> {
    same_device(op, first, ts)?;
    for (name, t) in ts {
        if t.dtype() != dtype {
            bail!("{op} (cuda): {name} is {:?}, expected {dtype:?}", t.dtype());
        }
    }
    Ok(())
}

/// Where a kernel writes an output: a buffer allocated for it, or a tensor the caller gives (a
/// decode arena's, so that a captured decode graph holds kernels only, no memory nodes).
pub(super) enum Dest<'a, T> {
    Fresh(CudaSlice<T>),
    Given(CudaView<'a, T>),
}

impl<'a, T: CudaDType + DeviceRepr> Dest<'a, T> {
    /// `len` elements: a view of `given` (its storage and layout, from `storage_and_layout`;
    /// checked contiguous, of `T`, exactly `len` elements), else a fresh buffer.
    ///
    /// # Safety
    /// A fresh buffer is uninitialised: the kernel must write every element.
    pub(super) unsafe fn new(dev: &CudaDevice, len: usize, given: Option<(&'a Storage, &Layout)>, op: &str, name: &str) -> Result<Self> {
        match given {
            Some((s, l)) => {
                if l.shape().elem_count() != len {
                    bail!("{op} (cuda): {name} holds {} elements, the kernel writes {len}", l.shape().elem_count());
                }
                // Written in place under the storage's read lock, as the KV caches are: the
                // device's one stream orders every use of the tensor.
                Ok(Self::Given(view::<T>(s, l, op, name, true)?))
            }
            None => Ok(Self::Fresh(unsafe { dev.alloc::<T>(len)? })),
        }
    }

    /// Pushes the output pointer onto a kernel's arguments.
    pub(super) fn push<'s: 'b, 'b>(&'s mut self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'b>) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        match self {
            Self::Fresh(s) => {
                b.arg(s);
            }
            Self::Given(v) => {
                b.arg(&*v);
            }
        }
    }

    /// The output as a tensor of `shape`: the fresh buffer wrapped, or `given` itself.
    pub(super) fn finish<S: Into<candle_core::Shape>>(self, dev: &CudaDevice, shape: S, given: Option<&Tensor>) -> Tensor {
        match (self, given) {
            (Self::Given(_), Some(t)) => t.clone(),
            (Self::Fresh(s), _) => wrap(s, dev, shape),
            (Self::Given(_), None) => unreachable!("a given view comes from a given tensor"),
        }
    }
}

/// Checks a given output tensor: on `first`'s device, of `dtype`, of shape `dims`.
pub(super) fn check_given(op: &str, name: &str, first: &Tensor, dtype: DType, dims: &[usize], given: Option<&Tensor>) -> Result<()> {
    if let Some(t) = given {
        same_device_dtype(op, dtype, first, &[(name, t)])?;
        if t.dims() != dims {
            bail!("{op} (cuda): {name} is {:?}, the kernel writes {dims:?}", t.dims());
        }
    }
    Ok(())
}

/// Storage guards of a pair of given outputs, held while their views are in use.
pub(super) type PairGuards<'a> = Option<((candle_core::StorageRef<'a>, &'a Layout), (candle_core::StorageRef<'a>, &'a Layout))>;

/// The guards of `outs` (a kernel's two outputs, given), for [`pair_given`].
pub(super) fn pair_guards<'a>(outs: Option<(&'a Tensor, &'a Tensor)>) -> PairGuards<'a> {
    outs.map(|(a, b)| (a.storage_and_layout(), b.storage_and_layout()))
}

/// Each given output's storage and layout, as [`Dest::new`] takes them.
pub(super) fn pair_given<'a>(guards: &'a PairGuards) -> [Option<(&'a Storage, &'a Layout)>; 2] {
    match guards {
        Some(((a, al), (b, bl))) => [Some((&**a, *al)), Some((&**b, *bl))],
        None => [None, None],
    }
}
