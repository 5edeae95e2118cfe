//! What a looped engine counts beside the common metrics: how deep its tokens ran and how its
//! CUDA graphs were used.

/// The counters of a looped engine ([`crate::EngineMetrics::looped`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoopedMetrics {
    /// `depth_histogram[d - 1]`: generated tokens that ran `d` loop steps, where the scheduler
    /// counts them (the depth scheduler; a request's first token comes from the full-depth
    /// prefill and counts at r_max).
    pub depth_histogram: Vec<u64>,
    /// CUDA graphs: decode graphs captured, and launches replayed from one.
    pub graph_captures: usize,
    pub graph_replays: usize,
    /// The nodes of the captured graphs, summed over them.
    pub graph_nodes: GraphNodes,
}

/// Nodes of captured CUDA graphs by kind. Memory nodes are the allocations and frees of the
/// outputs of ops that allocate; a decode body on the arena (`KernelPolicy::decode_arena`) has
/// few, whatever the layer count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphNodes {
    /// Kernel launches (ours, cuBLAS's, candle's).
    pub kernels: usize,
    /// Memory allocation and free nodes.
    pub memory: usize,
    /// Copies and memsets.
    pub copies: usize,
    /// Anything else (empty nodes, event nodes).
    pub other: usize,
}

impl std::ops::AddAssign for GraphNodes {
    fn add_assign(&mut self, o: Self) {
        self.kernels += o.kernels;
        self.memory += o.memory;
        self.copies += o.copies;
        self.other += o.other;
    }
}

/// How a runner used its CUDA graphs so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captures: usize,
    pub replays: usize,
    pub nodes: GraphNodes,
}

impl LoopedMetrics {
    /// Realised mean exit depth d̄ (0 when the scheduler counts no depths).
    pub fn mean_depth(&self) -> f64 {
        let n: u64 = self.depth_histogram.iter().sum();
        let s: u64 = self.depth_histogram.iter().enumerate().map(|(i, c)| (i as u64 + 1) * c).sum();
        if n == 0 {
            0.0
        } else {
            s as f64 / n as f64
        }
    }
}
