//! The GPU implementation of [`Communicator`]: NCCL, one communicator per GPU of one process
//! (`ncclCommInitAll`), collectives enqueued on candle's stream of each rank's device.
//!
//! NCCL is opened at run time (`libnccl.so.2`, found like any shared library: the loader's path
//! or `LD_LIBRARY_PATH`), so a CUDA build starts and serves on one GPU where NCCL is not
//! installed; asking for several GPUs there is a typed error naming the library.
//!
//! Collectives are asynchronous: a rank enqueues them and goes on; a rank that never arrives
//! leaves the others' kernels waiting on the GPU, which the host only sees when it reads a
//! result back. The ranks' driver ([`super::Ranks`]) bounds that wait and aborts the group when
//! a launch overstays it; `reset` then builds the group's communicators anew.
//!
//! Three NCCL rules shape the abort: no two host threads may call into one communicator at
//! once (each rank's handle sits behind its own lock, held for the length of a call);
//! `ncclCommAbort` frees the communicator, so the handle is taken out of its slot before the
//! call (a rank's next collective finds the slot empty and fails); and `ncclCommAbort` returns
//! only once every CUDA graph that captured the communicator is destroyed, which the ranks do on
//! their own threads before the group is rebuilt — so the abort runs on a thread of its own,
//! and `reset` waits for it. Connections are made eagerly at init (one all-reduce over every
//! rank, from one thread), so no later host call waits on a peer while holding its lock.

use super::Communicator;
use crate::{Error, Result};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type RawComm = *mut c_void;
type RawStream = *mut c_void;

/// The NCCL entry points Ponder calls (NCCL 2.x ABI).
struct Lib {
    _lib: libloading::Library,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> c_int,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    comm_abort: unsafe extern "C" fn(RawComm) -> c_int,
    comm_destroy: unsafe extern "C" fn(RawComm) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

/// `ncclSum`.
const SUM: c_int = 0;

impl Lib {
    fn open() -> Result<Self> {
        let names = ["libnccl.so.2", "libnccl.so"];
        // SAFETY: loading NCCL runs its initialisers only, which have no preconditions.
        let lib = names.iter().find_map(|n| unsafe { libloading::Library::new(*n) }.ok()).ok_or_else(|| {
            Error::InvalidOption(format!(
                "tensor parallelism on GPUs needs NCCL: none of {names:?} could be opened (install NCCL or add its lib directory to LD_LIBRARY_PATH)"
            ))
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has this signature in every NCCL 2.x release (nccl.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| Error::InvalidOption(format!("NCCL lacks {}: {e}", $name)))?
            };
        }
        Ok(Self {
            comm_init_all: sym!("ncclCommInitAll"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            comm_abort: sym!("ncclCommAbort"),
            comm_destroy: sym!("ncclCommDestroy"),
            error_string: sym!("ncclGetErrorString"),
            _lib: lib,
        })
    }

    /// `Ok` for `ncclSuccess`, else an error naming `what` and NCCL's reason.
    fn check(&self, code: c_int, what: &'static str, rank: usize, world: usize) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let text = unsafe { std::ffi::CStr::from_ptr((self.error_string)(code)) }.to_string_lossy().into_owned();
        Err(Error::Collective { collective: what, rank, world, reason: format!("NCCL error {code}: {text}") })
    }
}

/// The communicators of one group, rebuilt by `reset` after an abort.
struct Group {
    lib: Lib,
    devices: Vec<CudaDevice>,
    /// `comms[r]`: rank r's communicator (null once aborted), behind the lock every host call
    /// on it holds.
    comms: Vec<Mutex<RawComm>>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Signals when the thread running the last abort's `ncclCommAbort`s has finished.
    aborting: Mutex<Option<crossbeam_channel::Receiver<()>>>,
    /// How long `reset` waits for that thread.
    timeout: Duration,
}

// SAFETY: an NCCL communicator is an opaque handle any host thread may use, one call at a time:
// the raw handles are only used under their rank's lock, or after being taken out of it.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Group {
    /// New communicators for every device, connected: one all-reduce over all of them, issued
    /// from this thread in one NCCL group call, then waited for.
    fn init(lib: &Lib, devices: &[CudaDevice]) -> Result<Vec<RawComm>> {
        let world = devices.len();
        let ordinals: Vec<c_int> = devices.iter().map(|d| d.cuda_stream().context().ordinal() as c_int).collect();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` has room for `world` handles and `ordinals` names `world` devices.
        lib.check(unsafe { (lib.comm_init_all)(comms.as_mut_ptr(), world as c_int, ordinals.as_ptr()) }, "init", 0, world)?;
        let connected = Self::connect(lib, devices, &comms);
        if connected.is_err() {
            for &c in &comms {
                // SAFETY: communicators just made, used by nothing else.
                unsafe { (lib.comm_destroy)(c) };
            }
        }
        connected.map(|_| comms)
    }

    fn connect(lib: &Lib, devices: &[CudaDevice], comms: &[RawComm]) -> Result<()> {
        let world = devices.len();
        let bufs = devices.iter().map(|d| d.alloc_zeros::<f32>(1)).collect::<candle_core::Result<Vec<_>>>()?;
        let streams: Vec<_> = devices.iter().map(|d| d.cuda_stream()).collect();
        // SAFETY: one single-element f32 buffer per device, on that device's stream, each
        // reduced in place; the group call posts them all before any waits on another.
        unsafe {
            lib.check((lib.group_start)(), "init", 0, world)?;
            let mut posted = Ok(());
            for (r, (buf, stream)) in bufs.iter().zip(&streams).enumerate() {
                streams[r].context().bind_to_thread().map_err(|e| Error::Collective { collective: "init", rank: r, world, reason: e.to_string() })?;
                let (p, _sync) = buf.device_ptr(stream);
                posted = posted.and_then(|_| {
                    lib.check((lib.all_reduce)(p as *const c_void, p as *mut c_void, 1, 7, SUM, comms[r], stream.cu_stream() as RawStream), "init", r, world)
                });
            }
            posted.and(lib.check((lib.group_end)(), "init", 0, world))?;
        }
        for d in devices {
            d.synchronize()?;
        }
        Ok(())
    }

    /// Waits (up to the timeout) for the last abort's thread: NCCL frees an aborted group's
    /// resources there, once the ranks have dropped their graphs.
    fn finish_abort(&self) -> Result<()> {
        let Some(done) = self.aborting.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(()) };
        match done.recv_timeout(self.timeout) {
            Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Ok(()),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(Error::Collective {
                collective: "reset",
                rank: 0,
                world: self.devices.len(),
                reason: format!("NCCL's abort did not finish within {:?}", self.timeout),
            }),
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // An abort still running owns its handles; these are the live ones.
        for slot in &mut self.comms {
            let c = *slot.get_mut().unwrap_or_else(|e| e.into_inner());
            if !c.is_null() {
                // SAFETY: a live communicator no rank uses any more (the group is being dropped).
                unsafe { (self.lib.comm_destroy)(c) };
            }
        }
    }
}

/// Builds NCCL groups.
pub(crate) struct NcclGroup;

impl NcclGroup {
    /// One communicator per device, rank r on `devices[r]`, connected. (A launch's timeout is
    /// enforced by the ranks' driver, which waits on each launch's answers; `timeout` bounds
    /// how long a reset waits for an abort to finish.)
    #[allow(clippy::new_ret_no_self)]
    pub(crate) fn new(devices: &[Device], timeout: Duration) -> Result<Vec<Arc<dyn Communicator>>> {
        let devices: Vec<CudaDevice> = devices
            .iter()
            .map(|d| match d {
                Device::Cuda(c) => Ok(c.clone()),
                other => Err(Error::InvalidOption(format!("an NCCL rank on {other:?}"))),
            })
            .collect::<Result<_>>()?;
        let lib = Lib::open()?;
        let comms = Group::init(&lib, &devices)?.into_iter().map(Mutex::new).collect();
        let group = Arc::new(Group { lib, devices, comms, aborted: AtomicBool::new(false), reason: Mutex::new(None), aborting: Mutex::new(None), timeout });
        Ok((0..group.devices.len()).map(|rank| Arc::new(NcclComm { group: group.clone(), rank }) as Arc<dyn Communicator>).collect())
    }
}

/// One rank of an NCCL group.
pub(crate) struct NcclComm {
    group: Arc<Group>,
    rank: usize,
}

/// NCCL's `ncclDataType_t` for a candle dtype.
fn nccl_type(dtype: DType) -> Option<c_int> {
    Some(match dtype {
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
        _ => return None,
    })
}

impl NcclComm {
    fn device(&self) -> &CudaDevice {
        &self.group.devices[self.rank]
    }

    fn world(&self) -> usize {
        self.group.devices.len()
    }

    fn error(&self, what: &'static str, reason: impl Into<String>) -> Error {
        Error::Collective { collective: what, rank: self.rank, world: self.world(), reason: reason.into() }
    }

    /// Runs `call` with this rank's communicator under its lock (no other host thread calls
    /// into it meanwhile, nor aborts it), or fails with the reason the group was aborted.
    fn with_comm<T>(&self, what: &'static str, call: impl FnOnce(RawComm) -> Result<T>) -> Result<T> {
        let slot = self.group.comms[self.rank].lock().unwrap_or_else(|e| e.into_inner());
        if self.group.aborted.load(Ordering::SeqCst) || slot.is_null() {
            let reason = self.group.reason.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| "the group was aborted".into());
            return Err(self.error(what, reason));
        }
        call(*slot)
    }

    /// `t` contiguous on this rank's device, with its NCCL type.
    fn input(&self, t: &Tensor, what: &'static str) -> Result<(Tensor, c_int)> {
        if !t.device().same_device(&Device::Cuda(self.device().clone())) {
            return Err(self.error(what, format!("a tensor on {:?} given to the rank on GPU {}", t.device(), self.rank)));
        }
        let ty = nccl_type(t.dtype()).ok_or_else(|| self.error(what, format!("dtype {:?} has no NCCL type", t.dtype())))?;
        Ok((t.contiguous()?, ty))
    }

    /// Enqueues `call(src, dst, stream)` on this rank's stream with `t` as the source and a new
    /// buffer of `out_len` elements as the destination, which it returns as a tensor of `shape`.
    fn enqueue(&self, t: &Tensor, out_len: usize, shape: &[usize], what: &'static str, call: impl FnOnce(u64, u64, RawStream) -> c_int) -> Result<Tensor> {
        macro_rules! typed {
            ($T:ty) => {
                self.enqueue_typed::<$T>(t, out_len, shape, what, call)
            };
        }
        match t.dtype() {
            DType::U8 => typed!(u8),
            DType::U32 => typed!(u32),
            DType::I64 => typed!(i64),
            DType::F16 => typed!(half::f16),
            DType::F32 => typed!(f32),
            DType::F64 => typed!(f64),
            DType::BF16 => typed!(half::bf16),
            d => Err(self.error(what, format!("dtype {d:?} has no NCCL type"))),
        }
    }

    fn enqueue_typed<T: CudaDType + DeviceRepr>(
        &self,
        t: &Tensor,
        out_len: usize,
        shape: &[usize],
        what: &'static str,
        call: impl FnOnce(u64, u64, RawStream) -> c_int,
    ) -> Result<Tensor> {
        let dev = self.device();
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().map_err(|e| self.error(what, e.to_string()))?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(self.error(what, "not a CUDA tensor"));
        };
        let start = layout.start_offset();
        let src = cs.as_cuda_slice::<T>()?.slice(start..start + layout.shape().elem_count());
        // SAFETY: NCCL writes every element of the destination.
        let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(out_len.max(1)) }?;
        let code = {
            let (s, _sync_s) = src.device_ptr(&stream);
            let (d, _sync_d) = out.device_ptr_mut(&stream);
            call(s, d, stream.cu_stream() as RawStream)
        };
        drop(storage);
        self.group.lib.check(code, what, self.rank, self.world())?;
        let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
        let out = Tensor::from_storage(Storage::Cuda(storage), out_len.max(1), candle_core::op::BackpropOp::none(), false);
        Ok(out.narrow(0, 0, out_len)?.reshape(shape)?)
    }
}

impl NcclComm {
    /// `[world, ..t.dims()]`: every rank's `t` (the same shape on every rank) in rank order.
    fn gather_equal(&self, t: &Tensor) -> Result<Tensor> {
        const WHAT: &str = "all_gather";
        let (t, ty) = self.input(t, WHAT)?;
        let (n, world) = (t.elem_count(), self.world());
        let mut shape = vec![world];
        shape.extend_from_slice(t.dims());
        let lib = &self.group.lib;
        // SAFETY: the destination holds `world · n` elements: every rank's `n` in rank order.
        self.with_comm(WHAT, |comm| {
            self.enqueue(&t, world * n, &shape, WHAT, |s, d, stream| unsafe { (lib.all_gather)(s as *const c_void, d as *mut c_void, n, ty, comm, stream) })
        })
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        const WHAT: &str = "all_reduce_sum";
        let (t, ty) = self.input(t, WHAT)?;
        let n = t.elem_count();
        let lib = &self.group.lib;
        // SAFETY: source and destination hold `n` elements of type `ty` on this rank's device;
        // the call is ordered on the device's stream.
        self.with_comm(WHAT, |comm| {
            self.enqueue(&t, n, t.dims(), WHAT, |s, d, stream| unsafe { (lib.all_reduce)(s as *const c_void, d as *mut c_void, n, ty, SUM, comm, stream) })
        })
    }

    /// NCCL gathers equal parts, which the callers give by construction; the shapes are not
    /// exchanged first (a host read of the device, which a captured graph cannot hold).
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const WHAT: &str = "all_gather";
        if dim >= t.rank() {
            return Err(self.error(WHAT, format!("dimension {dim} of a rank-{} tensor", t.rank())));
        }
        let parts = self.gather_equal(t)?;
        // [world, ..dims] → the parts side by side along `dim`.
        let parts: Vec<Tensor> = (0..self.world()).map(|r| parts.get(r)).collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&parts, dim)?)
    }

    /// Parts may differ in their first dimension (the rows sent to each rank); their other
    /// dimensions and dtype must be the same on every rank.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const WHAT: &str = "all_to_all";
        let world = self.world();
        if parts.len() != world {
            return Err(self.error(WHAT, format!("{} parts for {world} ranks", parts.len())));
        }
        // First every rank's row counts, so that each knows what it receives.
        let rows: Vec<i64> = parts.iter().map(|p| p.dims().first().copied().unwrap_or(1) as i64).collect();
        let counts = self.gather_equal(&Tensor::new(rows.as_slice(), &Device::Cuda(self.device().clone()))?)?.flatten_all()?.to_vec1::<i64>()?;
        let parts = parts.iter().map(|p| self.input(p, WHAT)).collect::<Result<Vec<_>>>()?;
        let lib = &self.group.lib;
        let dev = self.device();
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().map_err(|e| self.error(WHAT, e.to_string()))?;
        let (ty, dtype, tail) = (parts[0].1, parts[0].0.dtype(), parts[0].0.dims().get(1..).unwrap_or(&[]).to_vec());
        let row: usize = tail.iter().product();
        // Receive buffers: from rank j, its count for this rank times the row width.
        let recv: Vec<Tensor> = (0..world)
            .map(|j| {
                let mut shape = vec![counts[j * world + self.rank] as usize];
                shape.extend_from_slice(&tail);
                Tensor::zeros(shape, dtype, &Device::Cuda(dev.clone()))
            })
            .collect::<candle_core::Result<_>>()?;
        let ptr = |t: &Tensor| -> Result<u64> {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                return Err(self.error(WHAT, "not a CUDA tensor"));
            };
            let base = match dtype {
                DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
                DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
                DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
                DType::F64 => cs.as_cuda_slice::<f64>()?.device_ptr(&stream).0,
                DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
                DType::I64 => cs.as_cuda_slice::<i64>()?.device_ptr(&stream).0,
                DType::U8 => cs.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
                d => return Err(self.error(WHAT, format!("dtype {d:?} has no NCCL type"))),
            };
            Ok(base + (layout.start_offset() * dtype.size_in_bytes()) as u64)
        };
        for (p, _) in &parts {
            if p.dims().get(1..).unwrap_or(&[]) != tail.as_slice() {
                return Err(self.error(WHAT, "parts differ past their first dimension"));
            }
        }
        let sends = parts.iter().map(|(p, _)| ptr(p)).collect::<Result<Vec<_>>>()?;
        let receives = recv.iter().map(ptr).collect::<Result<Vec<_>>>()?;
        let raw = stream.cu_stream() as RawStream;
        // SAFETY: group semantics: every send and receive below is posted before any may block;
        // each buffer holds the element count passed with it and lives until the stream has run
        // them (the parts are held until this returns, the receive buffers are returned, and
        // later uses of either are ordered after on the same stream).
        self.with_comm(WHAT, |comm| unsafe {
            lib.check((lib.group_start)(), WHAT, self.rank, world)?;
            let mut posted = Ok(());
            for j in 0..world {
                let m = counts[j * world + self.rank] as usize * row;
                posted = posted
                    .and_then(|_| lib.check((lib.send)(sends[j] as *const c_void, parts[j].0.elem_count(), ty, j as c_int, comm, raw), WHAT, self.rank, world))
                    .and_then(|_| lib.check((lib.recv)(receives[j] as *mut c_void, m, ty, j as c_int, comm, raw), WHAT, self.rank, world));
            }
            let ended = lib.check((lib.group_end)(), WHAT, self.rank, world);
            posted.and(ended)
        })?;
        Ok(recv)
    }

    fn abort(&self, reason: &str) -> bool {
        self.group.reason.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(|| reason.to_string());
        if self.group.aborted.swap(true, Ordering::SeqCst) {
            return false;
        }
        // The aborts run on a thread of their own: `ncclCommAbort` ends kernels stuck in a
        // collective at once, but returns only once the graphs that captured the communicator
        // are destroyed, which the ranks do before the group is rebuilt. Each handle leaves its
        // slot under the slot's lock (no call into it is under way), so no rank calls into a
        // communicator being freed: first the slots free now, then — once those aborts have
        // freed any peer stuck waiting on them — the rest.
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        *self.group.aborting.lock().unwrap_or_else(|e| e.into_inner()) = Some(done_rx);
        let group = self.group.clone();
        let spawned = std::thread::Builder::new().name("ponder-nccl-abort".into()).spawn(move || {
            let abort = |c: RawComm| {
                if !c.is_null() {
                    // SAFETY: a communicator of this group no rank can reach any more (its slot
                    // is empty); NCCL allows aborting one whose kernels are still running.
                    unsafe { (group.lib.comm_abort)(c) };
                }
            };
            let mut busy = Vec::new();
            for (r, slot) in group.comms.iter().enumerate() {
                match slot.try_lock() {
                    Ok(mut c) => abort(std::mem::replace(&mut *c, std::ptr::null_mut())),
                    Err(_) => busy.push(r),
                }
            }
            for r in busy {
                let mut c = group.comms[r].lock().unwrap_or_else(|e| e.into_inner());
                abort(std::mem::replace(&mut *c, std::ptr::null_mut()));
            }
            let _ = done_tx.send(());
        });
        if spawned.is_err() {
            // No thread for the abort: the communicators are left as they are (their kernels
            // may hang until the process ends), and the group stays aborted.
            *self.group.reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{reason} (and no thread could be started to abort NCCL)"));
        }
        true
    }

    fn is_aborted(&self) -> bool {
        self.group.aborted.load(Ordering::SeqCst)
    }

    fn reset(&self) {
        if !self.group.aborted.load(Ordering::SeqCst) {
            return;
        }
        // The ranks have dropped their graphs and drained their devices (the ranks' driver runs
        // that before a reset): the abort can finish, and the group is made anew.
        let rebuilt = self.group.finish_abort().and_then(|_| {
            for d in &self.group.devices {
                d.synchronize()?;
            }
            Group::init(&self.group.lib, &self.group.devices)
        });
        match rebuilt {
            Ok(fresh) => {
                for (slot, c) in self.group.comms.iter().zip(fresh) {
                    *slot.lock().unwrap_or_else(|e| e.into_inner()) = c;
                }
                *self.group.reason.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.group.aborted.store(false, Ordering::SeqCst);
            }
            // Left aborted: every later collective fails with this reason.
            Err(e) => *self.group.reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("the group could not be rebuilt after a failure: {e}")),
        }
    }
}
