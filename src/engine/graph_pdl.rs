//! Programmatic dependent launch inside a captured CUDA graph (Hopper and later).
//!
//! A decode step is hundreds of short kernels in a chain; between two of them the GPU drains
//! the first, then launches the second. When the second is one of our kernels that waits for
//! its predecessor itself (`ops::cuda::programmatic_kernels`), the edge between them can be
//! made *programmatic*: the second kernel's blocks are scheduled while the first finishes and
//! start the moment its writes are visible.
//!
//! Stream capture records a chain: every node depends on the one before. Candle allocates and
//! frees through the stream, so memory nodes sit between the kernels, and a programmatic edge
//! may only join two kernel nodes. [`rewrite`] therefore rebuilds the chain's edges:
//! - a *work* node (kernel, copy, memset, …) depends on the previous work node — by a
//!   programmatic edge when both are kernels and the later one waits for itself — and on the
//!   allocations recorded since that node;
//! - an allocation depends on the work node before the previous one (and on the frees recorded
//!   before that node), so it exists before the kernel that first writes it without standing
//!   between that kernel and its predecessor;
//! - a free depends on the previous work node, the allocations since and the previous free.
//!   Frees in a chain of their own let an allocation be ordered after every earlier free with
//!   one edge, so the graph may hand freed memory out again (its footprint stays near the
//!   captured one's) — never to an allocation whose first user could still overlap a user of
//!   the freed memory.
//!
//! Every work node still completes after all nodes before it: a programmatic dependent cannot
//! finish before its own `griddepcontrol.wait` returns.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// What a node is for the rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeKind {
    /// A kernel; `true` when it waits for its predecessor itself.
    Kernel(bool),
    Alloc,
    Free,
    /// Any other node (copy, memset, host, event): ordered like a kernel that does not wait.
    Other,
}

/// One edge of the rebuilt graph, by positions in the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Edge {
    pub from: usize,
    pub to: usize,
    pub programmatic: bool,
}

/// The rebuilt edges of a chain of nodes of `kinds` (in chain order). See the module docs.
pub(crate) fn chain_edges(kinds: &[NodeKind]) -> Vec<Edge> {
    let mut edges = Vec::new();
    let (mut last_work, mut before_last): (Option<usize>, Option<usize>) = (None, None);
    let mut last_free = None;
    // Per work node: the last free recorded before it.
    let mut free_before = vec![None; kinds.len()];
    let mut allocs: Vec<usize> = Vec::new();
    let plain = |from, to| Edge { from, to, programmatic: false };
    for (i, &kind) in kinds.iter().enumerate() {
        match kind {
            NodeKind::Alloc => {
                if let Some(w) = before_last {
                    edges.push(plain(w, i));
                    edges.extend(free_before[w].map(|f| plain(f, i)));
                }
                allocs.push(i);
            }
            NodeKind::Free => {
                edges.extend(last_work.map(|w| plain(w, i)));
                edges.extend(allocs.iter().map(|&a| plain(a, i)));
                edges.extend(last_free.map(|f| plain(f, i)));
                last_free = Some(i);
            }
            NodeKind::Kernel(_) | NodeKind::Other => {
                if let Some(w) = last_work {
                    let programmatic = matches!((kinds[w], kind), (NodeKind::Kernel(_), NodeKind::Kernel(true)));
                    edges.push(Edge { from: w, to: i, programmatic });
                }
                edges.extend(allocs.drain(..).map(|a| plain(a, i)));
                free_before[i] = last_free;
                before_last = last_work;
                last_work = Some(i);
            }
        }
    }
    edges
}

#[cfg(feature = "cuda")]
pub(crate) use driver::{enabled, restore, rewrite};

/// The driver calls: reading the captured chain, rewriting its edges.
#[cfg(feature = "cuda")]
mod driver {
    use super::{chain_edges, Edge, NodeKind};
    use candle_core::cuda_backend::cudarc::driver::sys::{self, CUgraph, CUgraphNode, CUgraphNodeType};
    use candle_core::{Error, Result};

    /// Whether graphs on this device get programmatic edges: compute capability 9.0 or later, a
    /// driver of CUDA 12.3 or later (the edge-data graph API), and `PONDER_PDL` not `0`.
    pub(crate) fn enabled(ctx: &candle_core::cuda_backend::cudarc::driver::CudaContext) -> bool {
        use sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
        if std::env::var("PONDER_PDL").is_ok_and(|v| v == "0") {
            return false;
        }
        let mut driver = 0;
        // SAFETY: writes one int.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) } == sys::CUresult::CUDA_SUCCESS && driver >= 12030;
        driver_ok && ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).is_ok_and(|major| major >= 9)
    }

    fn check(r: sys::CUresult, what: &str) -> Result<()> {
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(Error::Msg(format!("CUDA graph PDL rewrite: {what}: {e:?}"))),
        }
    }

    /// The original edges of a graph, to put back if the rewritten graph does not instantiate.
    pub(crate) struct OriginalEdges {
        from: Vec<CUgraphNode>,
        to: Vec<CUgraphNode>,
        data: Vec<sys::CUgraphEdgeData>,
    }

    /// Rewrites `graph`'s chain as described in the module docs. Returns the number of
    /// programmatic edges and the edges it replaced, or `None` (graph untouched) when the graph is
    /// not a single chain or has no edge to make programmatic.
    ///
    /// # Safety
    /// `graph` must be a valid graph not being instantiated or launched concurrently.
    pub(crate) unsafe fn rewrite(graph: CUgraph) -> Result<Option<(usize, OriginalEdges)>> {
        let nodes = unsafe { graph_nodes(graph)? };
        let original = unsafe { graph_edges(graph)? };
        let Some(order) = chain_order(&nodes, &original.from, &original.to) else {
            return Ok(None);
        };
        let names = crate::ops::cuda::programmatic_kernels();
        let kinds: Vec<NodeKind> = order.iter().map(|&n| unsafe { node_kind(n, names) }).collect::<Result<_>>()?;
        let edges = chain_edges(&kinds);
        let programmatic = edges.iter().filter(|e| e.programmatic).count();
        if programmatic == 0 {
            return Ok(None);
        }
        unsafe { set_edges(graph, &original, &order, &edges)? };
        Ok(Some((programmatic, original)))
    }

    /// Puts `original` back in place of whatever edges `graph` has now.
    ///
    /// # Safety
    /// As for [`rewrite`].
    pub(crate) unsafe fn restore(graph: CUgraph, original: &OriginalEdges) -> Result<()> {
        let now = unsafe { graph_edges(graph)? };
        unsafe { replace_edges(graph, &now, original) }
    }

    unsafe fn graph_nodes(graph: CUgraph) -> Result<Vec<CUgraphNode>> {
        let mut n = 0usize;
        check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }, "count nodes")?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        check(unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }, "list nodes")?;
        nodes.truncate(n);
        Ok(nodes)
    }

    unsafe fn graph_edges(graph: CUgraph) -> Result<OriginalEdges> {
        let mut n = 0usize;
        let none = std::ptr::null_mut();
        check(unsafe { sys::cuGraphGetEdges_v2(graph, none, none, std::ptr::null_mut(), &mut n) }, "count edges")?;
        let mut from: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
        let mut to: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: a plain C struct of bytes; all zeros is the default edge.
        let mut data = vec![unsafe { std::mem::zeroed::<sys::CUgraphEdgeData>() }; n];
        check(unsafe { sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n) }, "list edges")?;
        from.truncate(n);
        to.truncate(n);
        data.truncate(n);
        Ok(OriginalEdges { from, to, data })
    }

    /// The nodes in chain order, if every node has at most one edge in and one out and they form
    /// one path through all nodes.
    fn chain_order(nodes: &[CUgraphNode], from: &[CUgraphNode], to: &[CUgraphNode]) -> Option<Vec<CUgraphNode>> {
        use std::collections::HashMap;
        let mut next: HashMap<CUgraphNode, CUgraphNode> = HashMap::new();
        let mut has_pred: HashMap<CUgraphNode, ()> = HashMap::new();
        for (&f, &t) in from.iter().zip(to) {
            if next.insert(f, t).is_some() || has_pred.insert(t, ()).is_some() {
                return None;
            }
        }
        let mut roots = nodes.iter().filter(|n| !has_pred.contains_key(*n));
        let (root, None) = (roots.next()?, roots.next()) else {
            return None;
        };
        let mut order = vec![*root];
        while let Some(&n) = next.get(order.last()?) {
            order.push(n);
            if order.len() > nodes.len() {
                return None;
            }
        }
        (order.len() == nodes.len()).then_some(order)
    }

    unsafe fn node_kind(node: CUgraphNode, waiting: &std::collections::HashSet<&str>) -> Result<NodeKind> {
        let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check(unsafe { sys::cuGraphNodeGetType(node, &mut ty) }, "node type")?;
        Ok(match ty {
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC => NodeKind::Alloc,
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => NodeKind::Free,
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => NodeKind::Kernel(unsafe { kernel_waits(node, waiting) }),
            _ => NodeKind::Other,
        })
    }

    /// Whether a kernel node runs one of our kernels that waits for its predecessor. A kernel
    /// whose name cannot be read (a library kernel launched by handle) does not.
    unsafe fn kernel_waits(node: CUgraphNode, waiting: &std::collections::HashSet<&str>) -> bool {
        // SAFETY: a plain C struct; the call fills it.
        let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        if unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) } != sys::CUresult::CUDA_SUCCESS || params.func.is_null() {
            return false;
        }
        let mut name: *const std::ffi::c_char = std::ptr::null();
        if unsafe { sys::cuFuncGetName(&mut name, params.func) } != sys::CUresult::CUDA_SUCCESS || name.is_null() {
            return false;
        }
        // SAFETY: the driver returns a NUL-terminated name that lives as long as the function.
        unsafe { std::ffi::CStr::from_ptr(name) }.to_str().is_ok_and(|n| waiting.contains(n))
    }

    unsafe fn set_edges(graph: CUgraph, original: &OriginalEdges, order: &[CUgraphNode], edges: &[Edge]) -> Result<()> {
        let programmatic = sys::CUgraphEdgeData {
            from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
            to_port: 0,
            type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
            reserved: [0; 5],
        };
        // SAFETY: as in `graph_edges`.
        let plain: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
        let new = OriginalEdges {
            from: edges.iter().map(|e| order[e.from]).collect(),
            to: edges.iter().map(|e| order[e.to]).collect(),
            data: edges.iter().map(|e| if e.programmatic { programmatic } else { plain }).collect(),
        };
        unsafe { replace_edges(graph, original, &new) }
    }

    unsafe fn replace_edges(graph: CUgraph, old: &OriginalEdges, new: &OriginalEdges) -> Result<()> {
        let n = old.from.len();
        check(unsafe { sys::cuGraphRemoveDependencies_v2(graph, old.from.as_ptr(), old.to.as_ptr(), old.data.as_ptr(), n) }, "remove edges")?;
        let m = new.from.len();
        check(unsafe { sys::cuGraphAddDependencies_v2(graph, new.from.as_ptr(), new.to.as_ptr(), new.data.as_ptr(), m) }, "add edges")
    }
}

#[cfg(test)]
mod tests {
    use super::NodeKind::{Alloc, Free, Kernel, Other};
    use super::{chain_edges, Edge};

    fn e(from: usize, to: usize, programmatic: bool) -> Edge {
        Edge { from, to, programmatic }
    }

    #[test]
    fn kernels_that_wait_get_programmatic_edges_and_allocations_move_one_kernel_earlier() {
        // 0 gemm, 1 alloc, 2 ours, 3 free, 4 alloc, 5 gemm, 6 alloc, 7 ours, 8 copy, 9 ours
        let kinds = [Kernel(false), Alloc, Kernel(true), Free, Alloc, Kernel(false), Alloc, Kernel(true), Other, Kernel(true)];
        let edges = chain_edges(&kinds);
        let want = vec![
            // The first allocation has no work node two back: a root.
            e(0, 2, true),
            e(1, 2, false),
            e(2, 3, false),
            e(0, 4, false),
            e(2, 5, false),
            e(4, 5, false),
            // Allocation 6: after work node 2 (no free was recorded before it).
            e(2, 6, false),
            e(5, 7, true),
            e(6, 7, false),
            e(7, 8, false),
            // A copy before our kernel: an ordinary edge.
            e(8, 9, false),
        ];
        assert_eq!(edges, want);
    }

    #[test]
    fn an_allocation_follows_the_frees_before_the_work_node_two_back() {
        // 0 k, 1 free, 2 k, 3 free, 4 k, 5 alloc, 6 ours
        let kinds = [Kernel(false), Free, Kernel(false), Free, Kernel(false), Alloc, Kernel(true)];
        let edges = chain_edges(&kinds);
        // Free 1 was recorded before kernel 2 (the node two back of alloc 5); free 3 was not.
        assert!(edges.contains(&e(2, 5, false)) && edges.contains(&e(1, 5, false)));
        assert!(!edges.contains(&e(3, 5, false)));
        // Frees form a chain.
        assert!(edges.contains(&e(1, 3, false)));
        assert!(edges.contains(&e(4, 6, true)) && edges.contains(&e(5, 6, false)));
    }

    #[test]
    fn every_work_node_follows_the_previous_one_and_every_node_but_roots_has_an_edge_in() {
        let kinds = [Alloc, Alloc, Kernel(false), Free, Free, Kernel(true), Kernel(true), Alloc, Free, Other];
        let edges = chain_edges(&kinds);
        let work: Vec<usize> = (0..kinds.len()).filter(|&i| !matches!(kinds[i], Alloc | Free)).collect();
        for w in work.windows(2) {
            assert!(edges.iter().any(|x| x.from == w[0] && x.to == w[1]), "work {} -> {}", w[0], w[1]);
        }
        // Frees follow the last work node and the allocations since it (alloc 7 before free 8).
        assert!(edges.contains(&e(6, 8, false)) && edges.contains(&e(7, 8, false)));
        // Both allocations before the first kernel are roots feeding it.
        assert!(edges.contains(&e(0, 2, false)) && edges.contains(&e(1, 2, false)));
        assert!(!edges.iter().any(|x| x.to == 0 || x.to == 1));
        for i in 2..kinds.len() {
            assert!(edges.iter().any(|x| x.to == i), "node {i} has no edge in");
        }
        let programmatic: Vec<&Edge> = edges.iter().filter(|x| x.programmatic).collect();
        assert_eq!(programmatic, vec![&e(2, 5, true), &e(5, 6, true)], "only kernel -> waiting kernel");
    }
}
