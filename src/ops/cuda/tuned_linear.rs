//! Decode-width projections `y = x · wᵀ` through cuBLASLt with the algorithm chosen by
//! measurement. cuBLAS's heuristic picks one kernel per shape from a model of the GPU; for the
//! skinny GEMMs of a decode step (a few to a few hundred rows against a weight of tens of MB)
//! the kernels it ranks below its first choice are often faster. The first time a (rows, out,
//! in, dtype) is seen outside a graph capture, the heuristic's candidates each run on a cold L2
//! (as a decode step meets its weights) and the fastest is kept for the process.
//!
//! Anything this path does not take — f32, more than [`MAX_ROWS`] rows, operands not 256-byte
//! aligned, a shape first seen inside a capture, `PONDER_DECODE_GEMM=cublas`, any cuBLASLt
//! failure — returns `None` and the caller runs candle's matmul, as before.

use super::launch::{kernel, Module};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{sys as drv, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Result, Storage, Tensor};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Widest row count tuned; wider GEMMs are compute-bound, where the heuristic's choice holds.
pub const MAX_ROWS: usize = 256;
/// cuBLASLt workspace (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Scratch read between timed runs: more than a Hopper's 50 MB L2.
const FLUSH_BYTES: usize = 96 << 20;
/// Candidates asked of the heuristic.
const CANDIDATES: usize = 16;
/// Timed runs per candidate (the median counts).
const RUNS: usize = 5;
/// A candidate within this fraction of the fastest counts as fast: the first such in the
/// heuristic's order is kept, so the choice does not flip between processes on timing noise.
const TIE: f32 = 0.03;

/// Whether the tuned path is on: `PONDER_DECODE_GEMM=cublas` turns it off (read once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("PONDER_DECODE_GEMM").map_or(true, |v| v.trim() != "cublas"))
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    rows: usize,
    out: usize,
    inp: usize,
    dtype: DType,
}

/// A shape's descriptors and chosen algorithm, built once.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    report: TunedShape,
}

/// What tuning found for one shape (see [`tuned_shapes`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TunedShape {
    pub rows: usize,
    pub out: usize,
    pub inp: usize,
    /// Candidates the heuristic offered.
    pub candidates: usize,
    /// Position of the kept one in the heuristic's order (0: its own first choice).
    pub chosen: usize,
    /// Median cold-L2 times of the heuristic's first choice and of the kept one, µs.
    pub heuristic_us: f32,
    pub chosen_us: f32,
}

/// Every shape tuned so far on any device, in no particular order (benchmarks print it).
pub fn tuned_shapes() -> Vec<TunedShape> {
    tuners().lock().values().flatten().flat_map(|t| t.plans.values().flatten().map(|p| p.report)).collect()
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Plan::describe`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// One device's cuBLASLt handle, workspace and plans (`None`: this shape runs on candle).
struct Tuner {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<Key, Option<Plan>>,
}

// SAFETY: the handle and descriptors are plain cuBLASLt objects used under the registry's lock.
unsafe impl Send for Tuner {}

impl Drop for Tuner {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `Tuner::new`, destroyed once here after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl Tuner {
    fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread().w()?;
        let handle = lt::create_handle().map_err(|e| candle_core::Error::Msg(format!("cublasLt: {e:?}")))?;
        // SAFETY: cuBLASLt's scratch; never read before it writes it.
        let workspace = match unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: just created, not shared.
                unsafe {
                    let _ = lt::destroy_handle(handle);
                }
                return Err(e).w();
            }
        };
        Ok(Self { handle, workspace, plans: HashMap::new() })
    }
}

type Tuners = HashMap<candle_core::cuda_backend::DeviceId, Option<Tuner>>;

/// Every device's tuner, by candle's device id (`None`: its handle or workspace could not be
/// had, and candle serves that device).
fn tuners() -> &'static Mutex<Tuners> {
    static T: OnceLock<Mutex<Tuners>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("tuned_linear: {what}: {e:?}"))
}

fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        _ => None,
    }
}

impl Plan {
    /// Descriptors for row-major `y [rows, out] = x [rows, inp] · w [out, inp]ᵀ`, seen by
    /// column-major cuBLASLt as `yᵀ [out, rows] = op_T(w) · xᵀ` (no copies).
    fn describe(key: Key, ty: sys::cudaDataType) -> Result<(sys::cublasLtMatmulDesc_t, [sys::cublasLtMatrixLayout_t; 3])> {
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F).map_err(|e| lt_err("desc", e))?;
        let trans: i32 = 1;
        // SAFETY: `desc` was just created; the attribute is a 4-byte cublasOperation_t.
        let set =
            unsafe { lt::set_matmul_desc_attribute(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, (&trans as *const i32).cast(), 4) };
        let (out, inp, rows) = (key.out as u64, key.inp as u64, key.rows as u64);
        let layouts = set.map_err(|e| lt_err("transa", e)).and_then(|()| {
            let a = lt::create_matrix_layout(ty, inp, out, inp as i64).map_err(|e| lt_err("layout w", e))?;
            let b = lt::create_matrix_layout(ty, inp, rows, inp as i64).map_err(|e| lt_err("layout x", e));
            let d = b.as_ref().ok().map(|_| lt::create_matrix_layout(ty, out, rows, out as i64).map_err(|e| lt_err("layout y", e)));
            match (b, d) {
                (Ok(b), Some(Ok(d))) => Ok([a, b, d]),
                (b, _) => {
                    // SAFETY: created above, not shared.
                    unsafe {
                        let _ = lt::destroy_matrix_layout(a);
                        if let Ok(b) = b {
                            let _ = lt::destroy_matrix_layout(b);
                        }
                    }
                    Err(lt_err("layout", "create failed"))
                }
            }
        });
        match layouts {
            Ok(l) => Ok((desc, l)),
            Err(e) => {
                // SAFETY: created above, not shared.
                unsafe {
                    let _ = lt::destroy_matmul_desc(desc);
                }
                Err(e)
            }
        }
    }
}

/// Raw device addresses of one GEMM's operands and its workspace.
#[derive(Clone, Copy)]
struct Operands {
    w: drv::CUdeviceptr,
    x: drv::CUdeviceptr,
    y: drv::CUdeviceptr,
    ws: drv::CUdeviceptr,
}

/// Queues one `y = x · wᵀ` with `algo` on `stream`.
///
/// # Safety
/// The operands hold the plan's shapes and outlive the queued work.
unsafe fn run(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    l: &[sys::cublasLtMatrixLayout_t; 3],
    algo: &sys::cublasLtMatmulAlgo_t,
    o: Operands,
    stream: &CudaStream,
) -> Result<()> {
    let (alpha, beta) = (1f32, 0f32);
    lt::matmul(
        handle,
        desc,
        (&alpha as *const f32).cast(),
        (&beta as *const f32).cast(),
        o.w as *const c_void,
        l[0],
        o.x as *const c_void,
        l[1],
        o.y as *const c_void,
        l[2],
        o.y as *mut c_void,
        l[2],
        algo,
        o.ws as *mut c_void,
        WORKSPACE_BYTES,
        stream.cu_stream() as _,
    )
    .map_err(|e| lt_err("matmul", e))
}

/// Times the heuristic's candidates for `key` on the live operands and returns the plan of the
/// fastest (ties to the heuristic's order). Synchronises the stream.
fn tune(dev: &CudaDevice, handle: sys::cublasLtHandle_t, key: Key, o: Operands) -> Result<Plan> {
    let ty = data_type(key.dtype).ok_or_else(|| lt_err("dtype", key.dtype))?;
    let (desc, l) = Plan::describe(key, ty)?;
    // SAFETY: a plain C struct, overwritten with the kept algorithm before use.
    let algo = unsafe { std::mem::zeroed() };
    let report = TunedShape { rows: key.rows, out: key.out, inp: key.inp, candidates: 0, chosen: 0, heuristic_us: 0.0, chosen_us: 0.0 };
    let mut plan = Plan { desc, a: l[0], b: l[1], d: l[2], algo, report };
    let pref = lt::create_matmul_pref().map_err(|e| lt_err("pref", e))?;
    let ws = WORKSPACE_BYTES;
    // SAFETY: `pref` was just created; the attribute is a u64 byte count.
    let set = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws as *const usize).cast(),
            8,
        )
    };
    let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; CANDIDATES];
    let mut count = 0i32;
    // SAFETY: every handle is live; `results` holds CANDIDATES entries.
    let got = set.and_then(|()| unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(handle, desc, l[0], l[1], l[2], l[2], pref, CANDIDATES as i32, results.as_mut_ptr(), &mut count).result()
    });
    // SAFETY: created above.
    unsafe {
        let _ = lt::destroy_matmul_pref(pref);
    }
    got.map_err(|e| lt_err("heuristic", e))?;
    let candidates: Vec<_> = results[..count.max(0) as usize]
        .iter()
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws)
        .map(|r| r.algo)
        .collect();
    if candidates.is_empty() {
        return Err(lt_err("heuristic", "no candidate"));
    }
    let stream = dev.cuda_stream();
    // Without room for the scratch (a KV pool may have taken the memory) the candidates are
    // timed on a warm L2: a worse proxy for decode, still a measurement.
    let flush = stream.alloc_zeros::<u8>(FLUSH_BYTES).ok().zip(stream.alloc_zeros::<u8>(16).ok());
    let start = stream.context().new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    let end = stream.context().new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    let mut medians = Vec::with_capacity(candidates.len());
    for algo in &candidates {
        // One untimed run: a candidate the GPU rejects is skipped.
        // SAFETY: operands of `key`'s shapes, alive for the whole tuning (it synchronises).
        if unsafe { run(handle, desc, &l, algo, o, &stream) }.is_err() {
            medians.push(f32::INFINITY);
            continue;
        }
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            if let Some((flush, sink)) = &flush {
                flush_l2(dev, flush, sink)?;
            }
            start.record(&stream).w()?;
            // SAFETY: as above.
            unsafe { run(handle, desc, &l, algo, o, &stream)? };
            end.record(&stream).w()?;
            times.push(start.elapsed_ms(&end).w()?);
        }
        times.sort_by(f32::total_cmp);
        medians.push(times[RUNS / 2]);
    }
    stream.synchronize().w()?;
    let best = medians.iter().copied().fold(f32::INFINITY, f32::min);
    if !best.is_finite() {
        return Err(lt_err("tuning", "every candidate failed"));
    }
    let pick = medians.iter().position(|&t| t <= best * (1.0 + TIE)).unwrap_or(0);
    plan.algo = candidates[pick];
    plan.report = TunedShape { candidates: candidates.len(), chosen: pick, heuristic_us: medians[0] * 1e3, chosen_us: medians[pick] * 1e3, ..plan.report };
    Ok(plan)
}

/// Reads the flush buffer once (see `flush_l2_by_reading` in fused.cu).
fn flush_l2(dev: &CudaDevice, flush: &CudaSlice<u8>, sink: &CudaSlice<u8>) -> Result<()> {
    let func = kernel!(dev, Module::Fused, "flush_l2_by_reading")?;
    let words = (FLUSH_BYTES / 16) as u64;
    let cfg = LaunchConfig { grid_dim: (132 * 8, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(flush).arg(&words).arg(sink);
    // SAFETY: argument list matches `flush_l2_by_reading`; the buffer holds `words` 16-byte words.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// `x [rows, inp] · w [out, inp]ᵀ` through a tuned cuBLASLt algorithm, or `None` where this path
/// does not apply (see the module docs) and the caller should use candle's matmul.
pub fn tuned_linear(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let dtype = x.dtype();
    if !enabled() || data_type(dtype).is_none() || w.dtype() != dtype || x.rank() != 2 || w.rank() != 2 || !x.is_contiguous() || !w.is_contiguous() {
        return Ok(None);
    }
    let (rows, inp) = x.dims2()?;
    let (out, w_inp) = w.dims2()?;
    if rows == 0 || rows > MAX_ROWS || w_inp != inp || !x.device().same_device(w.device()) {
        return Ok(None);
    }
    let candle_core::Device::Cuda(dev) = x.device() else { return Ok(None) };
    match dtype {
        DType::BF16 => launch::<half::bf16>(dev, x, w, Key { rows, out, inp, dtype }),
        _ => launch::<half::f16>(dev, x, w, Key { rows, out, inp, dtype }),
    }
}

fn launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, x: &Tensor, w: &Tensor, key: Key) -> Result<Option<Tensor>> {
    let stream = dev.cuda_stream();
    let capturing = stream.capture_status().w()? != drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut tuners = tuners().lock();
    let tuner = match tuners.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(_) if capturing => return Ok(None),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(Tuner::new(&stream).map_err(|e| tracing::warn!("tuned_linear: {e}; candle serves every GEMM")).ok())
        }
    };
    let Some(tuner) = tuner.as_mut() else { return Ok(None) };
    if capturing && !tuner.plans.contains_key(&key) {
        return Ok(None);
    }
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cuda(xs), Storage::Cuda(ws)) = (&*xs, &*ws) else { return Ok(None) };
    let xv = xs.as_cuda_slice::<T>()?.slice(xl.start_offset()..xl.start_offset() + key.rows * key.inp);
    let wv = ws.as_cuda_slice::<T>()?.slice(wl.start_offset()..wl.start_offset() + key.out * key.inp);
    // SAFETY: cuBLASLt writes every element of y.
    let y = unsafe { dev.alloc::<T>(key.rows * key.out)? };
    let (xp, _gx) = xv.device_ptr(&stream);
    let (wp, _gw) = wv.device_ptr(&stream);
    let (yp, _gy) = y.device_ptr(&stream);
    let (wsp, _gws) = tuner.workspace.device_ptr(&stream);
    // cuBLASLt assumes 256-byte aligned operands unless told otherwise.
    if (xp | wp | yp) % 256 != 0 {
        return Ok(None);
    }
    let o = Operands { w: wp, x: xp, y: yp, ws: wsp };
    let handle = tuner.handle;
    let plan = tuner.plans.entry(key).or_insert_with(|| {
        tune(dev, handle, key, o).map_err(|e| tracing::warn!("tuned_linear {}x{}x{}: {e}; candle serves this shape", key.rows, key.out, key.inp)).ok()
    });
    let Some(plan) = plan.as_ref() else { return Ok(None) };
    // SAFETY: operands of the plan's shapes; `y` is returned and the inputs are held by the caller
    // until the stream has run the work (candle's stream order).
    if unsafe { run(handle, plan.desc, &[plan.a, plan.b, plan.d], &plan.algo, o, &stream) }.is_err() {
        return Ok(None);
    }
    drop((_gx, _gw, _gy, _gws));
    Ok(Some(super::launch::wrap(y, dev, (key.rows, key.out))))
}
