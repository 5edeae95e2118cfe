//! The W8A8 FP8 GEMM for launches of many rows (prefill, denoising), where a linear layer is
//! bound by the tensor cores and E4M3 has twice bf16's peak: the activations quantized a row
//! at a time (`quantize_rows`), then cuBLASLt's FP8 matmul with both scale vectors applied in
//! its epilogue ("outer vector" scaling: cuBLASLt 12.9 and later, sm_90 and later; elsewhere
//! [`fp8_w8a8_linear`] answers `None` and the layer computes W8A8 by its reference).
//!
//! cuBLASLt needs a handle: one per GPU, made at load ([`prepare_fp8_gemm`]) and kept for the
//! life of the process (destroying one synchronises the whole context). It holds no stream, so
//! every thread shares it (candle's devices run on per-thread default streams). The workspace
//! an algorithm asks for is allocated per call on the caller's stream, like any op's output, so
//! no two streams ever share one. The heuristic's algorithm is kept per shape and alignment.

use super::fp8::quantize_rows;
use super::launch::{device, same_device, view, wrap};
use candle_core::cuda_backend::cudarc::cublas::sys as cublas_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Most shapes whose plans a GPU keeps.
const MAX_PLANS: usize = 4096;

/// Most workspace bytes an algorithm may ask for (what cuBLASLt recommends for Hopper).
const MAX_WORKSPACE_BYTES: usize = 32 << 20;

/// One shape's matmul, made once: its descriptor and layouts (a call sets only the two scale
/// pointers), the heuristic's algorithm and the workspace it needs.
struct Plan {
    d: Descriptors,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// The heuristic's choice per (output dtype, rows, n, k, alignments of A, B and D).
type PlanKey = (DType, usize, usize, usize, [u32; 3]);

/// One GPU's cuBLASLt state; `None` where its FP8 GEMM is not available.
struct LtGpu {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
}

// SAFETY: the handle holds no stream and is only used under the mutex that owns this state.
unsafe impl Send for LtGpu {}

type Gpus = Mutex<HashMap<usize, Option<Arc<Mutex<LtGpu>>>>>;

fn gpus() -> &'static Gpus {
    static GPUS: OnceLock<Gpus> = OnceLock::new();
    GPUS.get_or_init(Default::default)
}

/// Makes the cuBLASLt handle of `dev`'s GPU if it has none yet (and learns whether its FP8 GEMM
/// is available). Model loading calls it for every GPU an FP8 layer is stored on, before any
/// graph is captured.
pub fn prepare_fp8_gemm(dev: &CudaDevice) -> Result<()> {
    lt_gpu(dev).map(|_| ())
}

fn lt_gpu(dev: &CudaDevice) -> Result<Option<Arc<Mutex<LtGpu>>>> {
    use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUstreamCaptureStatus};
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let mut all = gpus().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = all.get(&ordinal) {
        return Ok(g.clone());
    }
    let major = stream.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).w()?;
    // SAFETY: a query of the loaded library's version.
    let version = unsafe { sys::cublasLtGetVersion() };
    if major < 9 || version < 120_900 {
        all.insert(ordinal, None);
        return Ok(None);
    }
    if stream.capture_status().w()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        bail!("fp8 gemm (cuda): the GPU's cuBLASLt handle is made at load, not inside a graph capture");
    }
    let handle = lt::create_handle().map_err(|e| candle_core::Error::Msg(format!("cublasLtCreate: {e}")))?;
    let g = Some(Arc::new(Mutex::new(LtGpu { handle, plans: HashMap::new() })));
    all.insert(ordinal, g.clone());
    Ok(g)
}

/// The largest power of two (up to 256) that divides the address: the alignment cuBLASLt's
/// heuristic is told each operand has.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

/// Whether [`fp8_w8a8_linear`] takes a launch of this shape: n and k multiples of 16 (FP8
/// operands want 16-byte leading dimensions), sizes cuBLASLt's 32-bit dimensions hold, a bf16,
/// f16 or f32 output.
pub fn fp8_gemm_serves(dtype: DType, rows: usize, n: usize, k: usize) -> bool {
    let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32) && fits(rows) && fits(n) && fits(k) && n % 16 == 0 && k % 16 == 0
}

/// `x Wᵀ` for `x` `[rows, k]` (bf16 / f16 / f32) and `data` `[n, k]` E4M3 with `scale` `[n]` f32 (one a
/// row): every row of x quantized to E4M3 with its own scale, the FP8 product summed in f32,
/// times both scales, rounded to x's dtype. Equal to the f32 matmul of both dequantized
/// operands up to the order of the sums. `None` where x's GPU has no FP8 GEMM (before sm_90, or
/// cuBLASLt before 12.9).
pub fn fp8_w8a8_linear(x: &Tensor, data: &Tensor, scale: &Tensor) -> Result<Option<Tensor>> {
    const OP: &str = "fp8_w8a8_linear";
    let dev = device(x, OP)?;
    let (rows, k) = x.dims2()?;
    let (n, k_w) = data.dims2()?;
    if k != k_w || !fp8_gemm_serves(x.dtype(), rows, n, k) {
        bail!("{OP} (cuda): x [{rows}, {k}] {:?} against a weight [{n}, {k_w}]: needs equal k, n and k multiples of 16, bf16, f16 or f32", x.dtype());
    }
    check_weight(OP, n, data, scale)?;
    same_device(OP, x, &[("weight", data), ("scales", scale)])?;
    let Some(lt) = lt_gpu(&dev)? else { return Ok(None) };
    let (xq, xs) = quantize_rows(x)?;
    w8a8_gemm(&dev, &lt, (&xq, &xs), (data, scale), x.dtype(), (rows, n, k)).map(Some)
}

/// The product of [`fp8_w8a8_linear`] on activations already in E4M3: `xq` `[rows, k]` with one
/// f32 scale a row in `xs` `[rows]` (as [`quantize_rows`] makes them), against `data` `[n, k]`
/// E4M3 with `scale` `[n]`, rounded to `dtype` (bf16, f16 or f32). For a producer that writes
/// its output quantized, and for timing the GEMM apart from the quantization. `None` where the
/// GPU has no FP8 GEMM.
pub fn fp8_w8a8_quantized(xq: &Tensor, xs: &Tensor, data: &Tensor, scale: &Tensor, dtype: DType) -> Result<Option<Tensor>> {
    const OP: &str = "fp8_w8a8_linear";
    let dev = device(xq, OP)?;
    let (rows, k) = xq.dims2()?;
    let (n, k_w) = data.dims2()?;
    if k != k_w || !fp8_gemm_serves(dtype, rows, n, k) {
        bail!("{OP} (cuda): x [{rows}, {k}] against a weight [{n}, {k_w}] into {dtype:?}: needs equal k, n and k multiples of 16, bf16, f16 or f32");
    }
    if xq.dtype() != DType::F8E4M3 || xs.dtype() != DType::F32 || xs.dims() != [rows] {
        bail!("{OP} (cuda): activations {:?} with scales {:?} {:?}: needs E4M3 and [{rows}] f32", xq.dtype(), xs.dims(), xs.dtype());
    }
    check_weight(OP, n, data, scale)?;
    same_device(OP, xq, &[("activation scales", xs), ("weight", data), ("scales", scale)])?;
    let Some(lt) = lt_gpu(&dev)? else { return Ok(None) };
    w8a8_gemm(&dev, &lt, (xq, xs), (data, scale), dtype, (rows, n, k)).map(Some)
}

/// The FP8 GEMM of checked operands on `lt`, the GPU's cuBLASLt state.
fn w8a8_gemm(
    dev: &CudaDevice,
    lt: &Mutex<LtGpu>,
    (xq, xs): (&Tensor, &Tensor),
    (data, scale): (&Tensor, &Tensor),
    dtype: DType,
    (rows, n, k): (usize, usize, usize),
) -> Result<Tensor> {
    const OP: &str = "fp8_w8a8_linear";
    // The operands are read with 16-byte loads: a view that starts off that boundary (an
    // expert's rows of a stacked scale) is copied.
    let aligned16 = |t: &Tensor| (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 == 0;
    let data = data.contiguous()?;
    let scale = if scale.is_contiguous() && aligned16(scale) { scale.clone() } else { scale.affine(1.0, 0.0)? };
    let xq = xq.contiguous()?;
    let xs = if xs.is_contiguous() && aligned16(xs) { xs.clone() } else { xs.affine(1.0, 0.0)? };
    let mut lt = lt.lock().unwrap_or_else(|e| e.into_inner());
    match dtype {
        DType::BF16 => scaled_gemm::<half::bf16>(dev, &mut lt, &xq, &xs, &data, &scale, DType::BF16, (rows, n, k)),
        DType::F16 => scaled_gemm::<half::f16>(dev, &mut lt, &xq, &xs, &data, &scale, DType::F16, (rows, n, k)),
        DType::F32 => scaled_gemm::<f32>(dev, &mut lt, &xq, &xs, &data, &scale, DType::F32, (rows, n, k)),
        d => bail!("{OP} (cuda): dtype {d:?} not supported"),
    }
}

/// An E4M3 weight `[n, k]` with one f32 scale a row.
fn check_weight(op: &str, n: usize, data: &Tensor, scale: &Tensor) -> Result<()> {
    if data.dtype() != DType::F8E4M3 || scale.dtype() != DType::F32 || scale.dims() != [n] {
        bail!("{op} (cuda): weight {:?} with scales {:?} {:?}: needs E4M3 and [{n}] f32", data.dtype(), scale.dims(), scale.dtype());
    }
    Ok(())
}

/// A cuBLASLt status as a candle error naming the call.
fn lt_err(call: &'static str) -> impl Fn(lt::CublasError) -> candle_core::Error {
    move |e| candle_core::Error::Msg(format!("{call}: {e}"))
}

/// The descriptors of one shape's matmul, destroyed with its plan.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once and is destroyed once, here; failures to destroy are
        // not actionable.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_pref(self.pref);
        }
    }
}

/// Sets descriptor attribute `attr` to `value`.
///
/// # Safety
/// `desc` is live and `V` is the attribute's type.
unsafe fn set_desc<V>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, value: &V) -> Result<()> {
    lt::set_matmul_desc_attribute(desc, attr, value as *const V as *const c_void, std::mem::size_of::<V>()).map_err(lt_err("cublasLtMatmulDescSetAttribute"))
}

#[allow(clippy::too_many_arguments)]
fn scaled_gemm<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    lt_gpu: &mut LtGpu,
    xq: &Tensor,
    xs: &Tensor,
    wq: &Tensor,
    ws: &Tensor,
    dtype: DType,
    (rows, n, k): (usize, usize, usize),
) -> Result<Tensor> {
    const OP: &str = "fp8_w8a8_linear";
    use sys::cublasLtMatmulDescAttributes_t as Attr;
    let stream = dev.cuda_stream();
    let (xq_s, xq_l) = xq.storage_and_layout();
    let (xs_s, xs_l) = xs.storage_and_layout();
    let (wq_s, wq_l) = wq.storage_and_layout();
    let (ws_s, ws_l) = ws.storage_and_layout();
    let xq_v = view::<float8::F8E4M3>(&xq_s, xq_l, OP, "x (E4M3)", true)?;
    let xs_v = view::<f32>(&xs_s, xs_l, OP, "x scales", true)?;
    let wq_v = view::<float8::F8E4M3>(&wq_s, wq_l, OP, "weight", true)?;
    let ws_v = view::<f32>(&ws_s, ws_l, OP, "weight scales", true)?;
    // SAFETY: beta = 0 and every element of D is written.
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };
    let (w_ptr, _w_guard) = wq_v.device_ptr(&stream);
    let (x_ptr, _x_guard) = xq_v.device_ptr(&stream);
    let (wsc_ptr, _wsc_guard) = ws_v.device_ptr(&stream);
    let (xsc_ptr, _xsc_guard) = xs_v.device_ptr(&stream);
    let (o_ptr, _o_guard) = out.device_ptr_mut(&stream);
    // The heuristic picks for the operands' real alignment (its default assumes 256 bytes): a
    // weight narrowed to a rank's rows may start 16 bytes into an allocation.
    let aligned = [alignment(w_ptr), alignment(x_ptr), alignment(o_ptr)];
    let handle = lt_gpu.handle;
    let key = (dtype, rows, n, k, aligned);
    // A server meets every prompt length: the plans are bounded, dropped together when full (a
    // shape then costs one heuristic query again).
    if lt_gpu.plans.len() >= MAX_PLANS && !lt_gpu.plans.contains_key(&key) {
        lt_gpu.plans.clear();
    }
    let plan = match lt_gpu.plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(make_plan(handle, dtype, (rows, n, k), aligned, (wsc_ptr, xsc_ptr))?),
    };
    let [a_l, b_l, d_l] = plan.d.layouts;
    // SAFETY: the plan's descriptor is live (it lives as long as the GPU's state, under whose
    // lock this runs); the scale pointers are device pointers, the attributes' type.
    unsafe {
        set_desc(plan.d.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &(wsc_ptr as *const c_void))?;
        set_desc(plan.d.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &(xsc_ptr as *const c_void))?;
    }
    // The workspace this algorithm needs, on this call's stream (none for most shapes).
    // SAFETY: cuBLASLt only reads and writes inside the workspace it is given.
    let mut workspace = (plan.workspace > 0).then(|| unsafe { dev.alloc::<u8>(plan.workspace) }).transpose()?;
    let work = workspace.as_mut().map(|w| w.device_ptr_mut(&stream));
    let work_ptr = work.as_ref().map_or(0, |(p, _)| *p);
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: A, B, their scales, D and the workspace are live device buffers of the sizes the
    // layouts and the plan give (guards held to the end of the call); C = D with beta 0; every
    // buffer was made or last written on this stream.
    unsafe {
        lt::matmul(
            handle,
            plan.d.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            w_ptr as *const c_void,
            a_l,
            x_ptr as *const c_void,
            b_l,
            o_ptr as *const c_void,
            d_l,
            o_ptr as *mut c_void,
            d_l,
            &plan.algo,
            work_ptr as *mut c_void,
            plan.workspace,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(lt_err("cublasLtMatmul"))?;
    drop(work);
    drop((_w_guard, _x_guard, _wsc_guard, _xsc_guard, _o_guard));
    Ok(wrap(out, dev, (rows, n)))
}

/// The descriptors and the heuristic's algorithm of one shape (`rows` × `n` × `k`, the operands'
/// alignments), in cuBLASLt's FP8 "TN" form: the column-major view of the row-major product,
/// Dᵀ [n, rows] = op(A) [n, k] · B [k, rows] with A = the weight (k × n column-major,
/// transposed) and B = x (k × rows column-major); the outer-vector scales are A's n (a weight
/// row's) and B's rows (a token's).
/// The heuristic is asked with a call's scale pointers set (`scales`: the weight's, x's), as
/// every later call sets its own.
fn make_plan(handle: sys::cublasLtHandle_t, dtype: DType, (rows, n, k): (usize, usize, usize), aligned: [u32; 3], scales: (u64, u64)) -> Result<Plan> {
    const OP: &str = "fp8_w8a8_linear";
    use sys::cublasLtMatmulDescAttributes_t as Attr;
    use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
    // C (= D, beta 0) in the output's type: cuBLASLt's FP8 matmul takes bf16, f16 and f32 there.
    let out_type = match dtype {
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        _ => sys::cudaDataType_t::CUDA_R_16BF,
    };
    let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
    let layout = |ty, r: usize, c: usize, ld: usize| lt::create_matrix_layout(ty, r as u64, c as u64, ld as i64).map_err(lt_err("cublasLtMatrixLayoutCreate"));
    let desc =
        lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F).map_err(lt_err("cublasLtMatmulDescCreate"))?;
    let pref = match lt::create_matmul_pref() {
        Ok(p) => p,
        Err(e) => {
            // SAFETY: created just above, destroyed once.
            unsafe {
                let _ = lt::destroy_matmul_desc(desc);
            }
            return Err(lt_err("cublasLtMatmulPreferenceCreate")(e));
        }
    };
    let mut d = Descriptors { desc, layouts: [std::ptr::null_mut(); 3], pref };
    d.layouts[0] = layout(e4m3, k, n, k)?;
    d.layouts[1] = layout(e4m3, k, rows, k)?;
    d.layouts[2] = layout(out_type, n, rows, n)?;
    let [a_l, b_l, d_l] = d.layouts;
    // SAFETY: every attribute gets the type cuBLASLt documents for it (i32 enums, device
    // pointers, u32 alignments, a u64 byte count); the descriptors are live until `d` drops.
    unsafe {
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &(cublas_sys::cublasOperation_t::CUBLAS_OP_T as i32))?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &(cublas_sys::cublasOperation_t::CUBLAS_OP_N as i32))?;
        let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &(scales.0 as *const c_void))?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &(scales.1 as *const c_void))?;
        let pref_u64 = |attr, v: u64| {
            lt::set_matmul_pref_attribute(d.pref, attr, &v as *const u64 as *const c_void, std::mem::size_of::<u64>())
                .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))
        };
        let pref_u32 = |attr, v: u32| {
            lt::set_matmul_pref_attribute(d.pref, attr, &v as *const u32 as *const c_void, std::mem::size_of::<u32>())
                .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))
        };
        pref_u64(Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, MAX_WORKSPACE_BYTES as u64)?;
        pref_u32(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aligned[0])?;
        pref_u32(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, aligned[1])?;
        pref_u32(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, aligned[2])?;
        pref_u32(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, aligned[2])?;
    }
    // SAFETY: live descriptors and layouts; C's layout is D's.
    let found = unsafe { lt::get_matmul_algo_heuristic(handle, d.desc, a_l, b_l, d_l, d_l, d.pref) }
        .map_err(|e| candle_core::Error::Msg(format!("{OP}: cuBLASLt has no FP8 algorithm for [{rows}, {k}] × [{n}, {k}]ᵀ: {e}")))?;
    Ok(Plan { d, algo: found.algo, workspace: found.workspaceSize.min(MAX_WORKSPACE_BYTES) })
}
