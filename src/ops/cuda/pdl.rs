//! Programmatic dependent launch (Hopper and later) for our kernels inside a captured CUDA
//! graph.
//!
//! A decode step is hundreds of short kernels in a chain; between two of them the GPU drains
//! the first, then launches the second. When the second is one of ours — it starts with
//! `pdl_begin` (`kernels/pdl.cuh`): it lets its own dependents launch, then waits for the grid
//! before it — the edge between them can be *programmatic*: its blocks are scheduled while the
//! first kernel finishes and run the moment that kernel's writes are visible.
//!
//! Stream capture puts every node after the one before, and candle allocates and frees through
//! the stream, so memory nodes sit between the kernels; a programmatic edge may only join two
//! kernel nodes, and edges cannot be removed from a graph with memory nodes afterwards. So the
//! edges are chosen while capturing, around each of our launches ([`Gate`]):
//! - [`Gate::open`], before the launch's output allocations: finds the last kernel captured (A),
//!   stepping back over frees, and makes the allocations depend on what A depended on (plus the
//!   frees an earlier gate stepped over), not on A;
//! - [`Gate::close`], just before the launch: the kernel depends on A by a programmatic edge and
//!   on its allocations by ordinary ones.
//!
//! Frees stepped over are left as leaves that depend on A; a later gate's allocations are
//! ordered after them, so their memory can be handed out again. Every kernel still completes
//! after everything before it (its `griddepcontrol.wait` returns only when A has completed),
//! and it touches memory only after that wait.

use candle_core::cuda_backend::cudarc::driver::sys::{self, CUgraphNode, CUgraphNodeType, CUstream};
use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::{CudaDevice, Error, Result};
use std::cell::RefCell;

/// Capture state of the thread that is capturing (graphs are captured on the runner's thread).
struct Capture {
    /// Frees stepped over by the last gate that had no allocation to order after them.
    pending_frees: Vec<CUgraphNode>,
    programmatic_edges: usize,
}

thread_local! {
    static CAPTURE: RefCell<Option<Capture>> = const { RefCell::new(None) };
}

/// Whether this device gets programmatic edges: compute capability 9.0 or later, a driver of
/// CUDA 12.3 or later (the capture API with edge data), and `PONDER_PDL` not `0`.
pub fn enabled(ctx: &CudaContext) -> bool {
    use sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
    if std::env::var("PONDER_PDL").is_ok_and(|v| v == "0") {
        return false;
    }
    let mut driver = 0;
    // SAFETY: writes one int.
    let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) } == sys::CUresult::CUDA_SUCCESS && driver >= 12030;
    driver_ok && ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).is_ok_and(|major| major >= 9)
}

/// Gates on this thread add programmatic edges until [`end_capture`] (call right after the
/// stream's capture began, with [`enabled`]'s answer).
pub fn begin_capture(pdl: bool) {
    CAPTURE.with(|c| *c.borrow_mut() = pdl.then(|| Capture { pending_frees: Vec::new(), programmatic_edges: 0 }));
}

/// Ends the gates' work for this capture; returns how many programmatic edges they added.
pub fn end_capture() -> usize {
    CAPTURE.with(|c| c.borrow_mut().take().map_or(0, |c| c.programmatic_edges))
}

/// One of our launches while a graph is captured (inactive otherwise). Between `open` and
/// `close` the caller may only allocate on the stream: any other captured work would lose its
/// order after the kernel before (checked by `close`).
pub struct Gate {
    open: Option<Open>,
}

struct Open {
    stream: CUstream,
    /// The last kernel captured before this launch.
    after: CUgraphNode,
    /// The dependencies the allocations were given.
    alloc_deps: Vec<CUgraphNode>,
    /// Frees stepped over on the way back to `after`.
    frees: Vec<CUgraphNode>,
    /// Earlier frees included in `alloc_deps`.
    earlier_frees: Vec<CUgraphNode>,
}

impl Gate {
    /// Before the launch's allocations; `kernel` must be one of [`super::programmatic_kernels`]
    /// (otherwise, or when not capturing with PDL, the gate does nothing).
    pub fn open(dev: &CudaDevice, kernel: &str) -> Self {
        let active = CAPTURE.with(|c| c.borrow().is_some());
        if !active || !super::programmatic_kernels().contains(kernel) {
            return Self { open: None };
        }
        // A failed query or update leaves the stream's dependencies as they were: the launch
        // then keeps its ordinary order.
        // SAFETY: queries of the capturing stream and of nodes of its graph.
        Self { open: unsafe { Self::try_open(dev.cuda_stream().cu_stream()) }.ok().flatten() }
    }

    unsafe fn try_open(stream: CUstream) -> Result<Option<Open>> {
        let Some((after, frees)) = (unsafe { last_kernel(stream)? }) else {
            return Ok(None);
        };
        let mut alloc_deps = unsafe { dependencies(after)? };
        let earlier_frees = CAPTURE.with(|c| c.borrow().as_ref().map(|c| c.pending_frees.clone()).unwrap_or_default());
        alloc_deps.extend(&earlier_frees);
        unsafe { set_dependencies(stream, &alloc_deps, &[])? };
        Ok(Some(Open { stream, after, alloc_deps, frees, earlier_frees }))
    }

    /// Just before the launch: it will depend on the kernel before by a programmatic edge.
    pub fn close(self) -> Result<()> {
        let Some(o) = self.open else {
            return Ok(());
        };
        // SAFETY: as in `open`.
        let now = unsafe { capture_dependencies(o.stream)? };
        let allocated = !same_nodes(&now, &o.alloc_deps);
        if allocated {
            unsafe { check_allocations_only(&now, &o.alloc_deps)? };
        }
        let ordinary = if allocated { now } else { Vec::new() };
        unsafe { set_dependencies(o.stream, &ordinary, &[o.after])? };
        CAPTURE.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.programmatic_edges += 1;
                // Frees become pending once some allocation is ordered after the earlier ones.
                c.pending_frees = if allocated { o.frees } else { [o.earlier_frees, o.frees].concat() };
            }
        });
        Ok(())
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Error::Msg(format!("programmatic launch while capturing: {what}: {e:?}"))),
    }
}

fn same_nodes(a: &[CUgraphNode], b: &[CUgraphNode]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort();
    b.sort();
    a == b
}

/// The capturing stream's current dependencies (empty when it is not capturing).
unsafe fn capture_dependencies(stream: CUstream) -> Result<Vec<CUgraphNode>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut deps, mut data, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
    let r = unsafe { sys::cuStreamGetCaptureInfo_v3(stream, &mut status, std::ptr::null_mut(), std::ptr::null_mut(), &mut deps, &mut data, &mut n) };
    check(r, "capture info")?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the driver returns `n` nodes, valid until the next call on this stream.
    Ok(unsafe { std::slice::from_raw_parts(deps, n) }.to_vec())
}

unsafe fn node_type(node: CUgraphNode) -> Result<CUgraphNodeType> {
    let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    check(unsafe { sys::cuGraphNodeGetType(node, &mut ty) }, "node type")?;
    Ok(ty)
}

unsafe fn dependencies(node: CUgraphNode) -> Result<Vec<CUgraphNode>> {
    let mut n = 0usize;
    check(unsafe { sys::cuGraphNodeGetDependencies_v2(node, std::ptr::null_mut(), std::ptr::null_mut(), &mut n) }, "count dependencies")?;
    let mut deps: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: a plain C struct of bytes; the call fills it.
    let mut data = vec![unsafe { std::mem::zeroed::<sys::CUgraphEdgeData>() }; n];
    check(unsafe { sys::cuGraphNodeGetDependencies_v2(node, deps.as_mut_ptr(), data.as_mut_ptr(), &mut n) }, "dependencies")?;
    deps.truncate(n);
    Ok(deps)
}

/// The last kernel captured, stepping back over frees (returned too), when the stream's chain
/// ends that way; `None` for anything else (a copy, an allocation, a fork), which keeps its
/// ordinary order.
unsafe fn last_kernel(stream: CUstream) -> Result<Option<(CUgraphNode, Vec<CUgraphNode>)>> {
    let mut frees = Vec::new();
    let mut deps = unsafe { capture_dependencies(stream)? };
    loop {
        let [node] = deps[..] else {
            return Ok(None);
        };
        match unsafe { node_type(node)? } {
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => return Ok(Some((node, frees))),
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => {
                frees.push(node);
                deps = unsafe { dependencies(node)? };
            }
            _ => return Ok(None),
        }
    }
}

/// Between a gate's open and close only allocations were captured: a chain of allocation nodes
/// from `now` back to the dependencies the gate gave them.
unsafe fn check_allocations_only(now: &[CUgraphNode], alloc_deps: &[CUgraphNode]) -> Result<()> {
    let mut deps = now.to_vec();
    loop {
        let [node] = deps[..] else {
            return Err(Error::Msg("programmatic launch while capturing: work other than allocations between gate open and close".into()));
        };
        if unsafe { node_type(node)? } != CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
            return Err(Error::Msg("programmatic launch while capturing: a non-allocation node between gate open and close".into()));
        }
        deps = unsafe { dependencies(node)? };
        if same_nodes(&deps, alloc_deps) {
            return Ok(());
        }
    }
}

/// Sets what the next captured node depends on: `ordinary` nodes by default edges, each of
/// `programmatic` (kernels) by a programmatic edge.
unsafe fn set_dependencies(stream: CUstream, ordinary: &[CUgraphNode], programmatic: &[CUgraphNode]) -> Result<()> {
    // SAFETY: all-zero edge data is the default edge.
    let plain: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
    let prog = sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    // Experiment (`PONDER_PDL=order`): the same dependencies with ordinary edges only.
    let order_only = std::env::var("PONDER_PDL").is_ok_and(|v| v == "order");
    let prog = if order_only { plain } else { prog };
    let mut nodes: Vec<CUgraphNode> = ordinary.iter().chain(programmatic).copied().collect();
    let data: Vec<sys::CUgraphEdgeData> = ordinary.iter().map(|_| plain).chain(programmatic.iter().map(|_| prog)).collect();
    let flags = sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32;
    let r = unsafe { sys::cuStreamUpdateCaptureDependencies_v2(stream, nodes.as_mut_ptr(), data.as_ptr(), nodes.len(), flags) };
    check(r, "set dependencies")
}
