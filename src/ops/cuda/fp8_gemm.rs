//! The W8A8 FP8 GEMM for launches of many rows (prefill, denoising), where a linear layer is
//! bound by the tensor cores and E4M3 has twice bf16's peak: the activations quantized a row
//! at a time (`quantize_rows`), then cuBLASLt's FP8 matmul with both scale vectors applied in
//! its epilogue ("outer vector" scaling: cuBLASLt 12.9 and later, sm_90 and later).
//!
//! cuBLASLt needs a handle and a workspace. Both are made once per candle device (one stream)
//! at load ([`prepare_fp8_gemm`]) and kept for the life of the process: allocating inside a
//! CUDA-graph capture would tie the workspace to the graph, and destroying a handle
//! synchronises the whole context. The algorithm cuBLASLt's heuristic picks is kept per shape.

use super::fp8::quantize_rows;
use super::launch::{device, view, wrap};
use candle_core::cuda_backend::cudarc::cublas::sys as cublas_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Bytes of cuBLASLt workspace a device keeps (what cuBLASLt recommends for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One device's cuBLASLt state.
struct LtDevice {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// The heuristic's algorithm per (output dtype, rows, n, k).
    algos: HashMap<(DType, usize, usize, usize), sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the handle is only used under the mutex that owns this state, on the stream of the
// device it was made for.
unsafe impl Send for LtDevice {}

type Devices = Mutex<HashMap<DeviceId, Arc<Mutex<LtDevice>>>>;

fn devices() -> &'static Devices {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

/// Makes `dev`'s cuBLASLt handle and workspace if it has none yet. Model loading calls it for
/// every device an FP8 layer is stored on, before any graph is captured.
pub fn prepare_fp8_gemm(dev: &CudaDevice) -> Result<()> {
    lt_device(dev).map(|_| ())
}

fn lt_device(dev: &CudaDevice) -> Result<Arc<Mutex<LtDevice>>> {
    let mut all = devices().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = all.get(&dev.id()) {
        return Ok(d.clone());
    }
    let stream = dev.cuda_stream();
    if stream.capture_status().w()? != candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        bail!("fp8 gemm (cuda): the device's cuBLASLt workspace is made at load, not inside a graph capture");
    }
    let handle = lt::create_handle().map_err(|e| candle_core::Error::Msg(format!("cublasLtCreate: {e}")))?;
    // SAFETY: cuBLASLt only reads and writes inside the workspace it is given.
    let workspace = unsafe { dev.alloc::<u8>(WORKSPACE_BYTES)? };
    let d = Arc::new(Mutex::new(LtDevice { handle, workspace, algos: HashMap::new() }));
    all.insert(dev.id(), d.clone());
    Ok(d)
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
/// operands up to the order of the sums.
pub fn fp8_w8a8_linear(x: &Tensor, data: &Tensor, scale: &Tensor) -> Result<Tensor> {
    const OP: &str = "fp8_w8a8_linear";
    let dev = device(x, OP)?;
    let (rows, k) = x.dims2()?;
    let (n, k_w) = data.dims2()?;
    if k != k_w || !fp8_gemm_serves(x.dtype(), rows, n, k) {
        bail!("{OP} (cuda): x [{rows}, {k}] {:?} against a weight [{n}, {k_w}]: needs equal k, n and k multiples of 16, bf16, f16 or f32", x.dtype());
    }
    if data.dtype() != DType::F8E4M3 || scale.dtype() != DType::F32 || scale.dims() != [n] {
        bail!("{OP} (cuda): weight {:?} with scales {:?} {:?}: needs E4M3 and [{n}] f32", data.dtype(), scale.dims(), scale.dtype());
    }
    let (xq, xs) = quantize_rows(x)?;
    let (data, scale) = (data.contiguous()?, scale.contiguous()?);
    match x.dtype() {
        DType::BF16 => scaled_gemm::<half::bf16>(&dev, &xq, &xs, &data, &scale, DType::BF16, (rows, n, k)),
        DType::F16 => scaled_gemm::<half::f16>(&dev, &xq, &xs, &data, &scale, DType::F16, (rows, n, k)),
        DType::F32 => scaled_gemm::<f32>(&dev, &xq, &xs, &data, &scale, DType::F32, (rows, n, k)),
        d => bail!("{OP} (cuda): dtype {d:?} not supported"),
    }
}

/// A cuBLASLt status as a candle error naming the call.
fn lt_err(call: &'static str) -> impl Fn(lt::CublasError) -> candle_core::Error {
    move |e| candle_core::Error::Msg(format!("{call}: {e}"))
}

/// The descriptors of one matmul, destroyed when it ends.
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
            for l in self.layouts {
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

fn scaled_gemm<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    xq: &Tensor,
    xs: &Tensor,
    wq: &Tensor,
    ws: &Tensor,
    dtype: DType,
    (rows, n, k): (usize, usize, usize),
) -> Result<Tensor> {
    const OP: &str = "fp8_w8a8_linear";
    // C (= D, beta 0) in the output's type: cuBLASLt's FP8 matmul takes bf16, f16 and f32 there.
    let out_type = match dtype {
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        _ => sys::cudaDataType_t::CUDA_R_16BF,
    };
    use sys::cublasLtMatmulDescAttributes_t as Attr;
    let lt_dev = lt_device(dev)?;
    let mut lt_dev = lt_dev.lock().unwrap_or_else(|e| e.into_inner());
    let stream = dev.cuda_stream();
    let (xq_s, xq_l) = xq.storage_and_layout();
    let (xs_s, xs_l) = xs.storage_and_layout();
    let (wq_s, wq_l) = wq.storage_and_layout();
    let (ws_s, ws_l) = ws.storage_and_layout();
    let xq_v = view::<float8::F8E4M3>(&xq_s, xq_l, OP, "x (E4M3)", true)?;
    let xs_v = view::<f32>(&xs_s, xs_l, OP, "x scales", false)?;
    let wq_v = view::<float8::F8E4M3>(&wq_s, wq_l, OP, "weight", true)?;
    let ws_v = view::<f32>(&ws_s, ws_l, OP, "weight scales", false)?;
    // SAFETY: beta = 0 and every element of D is written.
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };

    // Column-major view of the row-major product, in cuBLASLt's FP8 "TN" form: Dᵀ [n, rows] =
    // op(A) [n, k] · B [k, rows] with A = the weight (k × n column-major, transposed) and B = x
    // (k × rows column-major). The outer-vector scales: A's n (a weight row's), B's rows (a token's).
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
    let (a_l, b_l, d_l) = (d.layouts[0], d.layouts[1], d.layouts[2]);

    let (w_ptr, _w_guard) = wq_v.device_ptr(&stream);
    let (x_ptr, _x_guard) = xq_v.device_ptr(&stream);
    let (wsc_ptr, _wsc_guard) = ws_v.device_ptr(&stream);
    let (xsc_ptr, _xsc_guard) = xs_v.device_ptr(&stream);
    let (o_ptr, _o_guard) = out.device_ptr_mut(&stream);
    let LtDevice { handle, workspace, algos } = &mut *lt_dev;
    let handle = *handle;
    let (work_ptr, _work_guard) = workspace.device_ptr_mut(&stream);
    // SAFETY: every attribute gets the type cuBLASLt documents for it (i32 enums, device
    // pointers, a u64 byte count); the descriptors are live until `d` drops.
    unsafe {
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &(cublas_sys::cublasOperation_t::CUBLAS_OP_T as i32))?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &(cublas_sys::cublasOperation_t::CUBLAS_OP_N as i32))?;
        let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &(wsc_ptr as *const c_void))?;
        set_desc(d.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &(xsc_ptr as *const c_void))?;
        let bytes = WORKSPACE_BYTES as u64;
        lt::set_matmul_pref_attribute(
            d.pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &bytes as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )
        .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?;
    }
    let key = (dtype, rows, n, k);
    let algo = match algos.get(&key) {
        Some(a) => *a,
        None => {
            // SAFETY: live descriptors and layouts; C's layout is D's.
            let found = unsafe { lt::get_matmul_algo_heuristic(handle, d.desc, a_l, b_l, d_l, d_l, d.pref) }
                .map_err(|e| candle_core::Error::Msg(format!("{OP}: cuBLASLt has no FP8 algorithm for [{rows}, {k}] × [{n}, {k}]ᵀ: {e}")))?;
            algos.insert(key, found.algo);
            found.algo
        }
    };
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: A, B, their scales, D and the workspace are live device buffers of the sizes the
    // layouts give (guards held to the end of the call); C = D with beta 0; the stream is the
    // device's own, which every buffer here was made or last written on.
    unsafe {
        lt::matmul(
            handle,
            d.desc,
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
            &algo,
            work_ptr as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(lt_err("cublasLtMatmul"))?;
    drop((_w_guard, _x_guard, _wsc_guard, _xsc_guard, _o_guard, _work_guard));
    Ok(wrap(out, dev, (rows, n)))
}
