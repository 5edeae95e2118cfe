//! What a looped launch reads from device memory and computes, counted on the host from the
//! launch's rows: the weights of the stages it runs, the K/V each row's attention reads for its
//! slot at its actual context length, and the FLOPs of both. Divided by measured bandwidth and
//! matmul peak these give a launch's roofline time (`bench_looped`).

use super::models::LoopedSpec;
use super::{LoopedLaunch, Stage};
use crate::engine::LaunchCost;

/// The cost of `launch` on a model of shape `spec`.
pub fn looped_launch_cost(spec: &LoopedSpec, launch: &LoopedLaunch) -> LaunchCost {
    let b = spec.dtype.size_in_bytes() as u64;
    let kv_per_position = 2 * (spec.num_kv_heads * spec.head_dim) as u64 * b;
    let attn_flops_per_key = 4.0 * (spec.num_heads * spec.head_dim) as f64;
    let sampled = launch.rows.iter().filter(|r| r.sample).count() as f64;
    let tokens = launch.num_tokens() as f64;
    let non_head = spec.boundary_params.saturating_sub(spec.head_params) as f64;
    // (attention layers applied per token, weights read, linear FLOPs)
    let (layers, weights, linear) = match launch.stage {
        Stage::Prefill | Stage::FullDepthDecode => {
            let steps = launch.step_slots.len();
            let layers = steps * spec.core_attention_layers + spec.prelude_attention_layers + spec.coda_attention_layers;
            let weights = spec.boundary_bytes + steps as u64 * spec.step_bytes;
            (layers, weights, 2.0 * (tokens * (steps as f64 * spec.step_params as f64 + non_head) + sampled * spec.head_params as f64))
        }
        Stage::CoreStep => (spec.core_attention_layers, spec.step_bytes, 2.0 * tokens * spec.step_params as f64),
        Stage::Coda => {
            // With re-entry the successor's prelude runs in the same launch.
            let prelude = if launch.reenter { spec.prelude_attention_layers } else { 0 };
            (spec.coda_attention_layers + prelude, spec.boundary_bytes, 2.0 * (tokens * non_head + sampled * spec.head_params as f64))
        }
    };
    let mut cost = LaunchCost { weight_bytes: weights, kv_bytes: 0, flops: linear };
    for row in &launch.rows {
        let (q, ctx) = (row.tokens.len() as u64, row.context_len() as u64);
        cost.kv_bytes += ctx * kv_per_position * layers as u64;
        // Causal: query i of the row sees ctx − q + i + 1 keys; summed over the q queries.
        let keys = q * (ctx - q) + q * (q + 1) / 2;
        cost.flops += keys as f64 * attn_flops_per_key * layers as f64;
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockTable;
    use crate::looped::LoopedRow;
    use candle_core::DType;

    fn spec() -> LoopedSpec {
        LoopedSpec {
            vocab_size: 100,
            hidden_size: 8,
            state_width: 8,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            num_kv_layers: 3,
            max_steps: 4,
            weight_bytes: 0,
            step_bytes: 2000,
            boundary_bytes: 1600,
            max_context: 64,
            boundary_params: 800,
            step_params: 1000,
            head_params: 800,
            core_attention_layers: 3,
            prelude_attention_layers: 0,
            coda_attention_layers: 0,
            heavy_coda: false,
            dtype: DType::BF16,
        }
    }

    fn row(tokens: usize, start: usize, sample: bool) -> LoopedRow {
        let mut r = LoopedRow::full_depth(crate::RequestId(0), vec![1; tokens], start, vec![BlockTable::from(vec![0u32; 8]); 4]);
        r.sample = sample;
        r
    }

    #[test]
    fn decode_counts_every_step_and_each_rows_context() {
        let launch = LoopedLaunch {
            stage: Stage::FullDepthDecode,
            step_slots: vec![0, 1, 2, 3],
            rows: vec![row(1, 9, true), row(1, 19, true)],
            kv_copies: vec![],
            reenter: false,
        };
        let c = looped_launch_cost(&spec(), &launch);
        assert_eq!(c.weight_bytes, (800 + 4 * 1000) * 2);
        // Contexts 10 and 20, 4 steps × 3 layers, K and V of one 4-wide head in bf16.
        assert_eq!(c.kv_bytes, (10 + 20) * 12 * 2 * 4 * 2);
        let attn = (10.0 + 20.0) * 4.0 * 8.0 * 12.0;
        assert_eq!(c.flops, 2.0 * 2.0 * (4.0 * 1000.0 + 800.0) + attn);
        assert!((c.roofline_seconds(1e3, 1e12) - c.bytes() as f64 / 1e3).abs() < 1e-12, "bandwidth-bound");
    }

    #[test]
    fn prefill_counts_causal_keys_and_the_head_only_where_sampled() {
        let launch = LoopedLaunch { stage: Stage::Prefill, step_slots: vec![0, 1, 2, 3], rows: vec![row(3, 2, false)], kv_copies: vec![], reenter: false };
        let c = looped_launch_cost(&spec(), &launch);
        // Queries at positions 2, 3, 4 see 3 + 4 + 5 keys.
        assert_eq!(c.flops, 2.0 * 3.0 * 4.0 * 1000.0 + 12.0 * 4.0 * 8.0 * 12.0);
        let core = LoopedLaunch { stage: Stage::CoreStep, step_slots: vec![], rows: vec![row(1, 5, false)], kv_copies: vec![], reenter: false };
        assert_eq!(looped_launch_cost(&spec(), &core).weight_bytes, 2000);
    }
}
