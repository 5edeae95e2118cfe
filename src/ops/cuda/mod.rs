//! CUDA kernels of our own (feature `cuda`). The PTX is built from `src/ops/kernels/*.cu` by
//! `build.rs` and loaded through candle's `CudaDevice::get_or_load_custom_func`; what every
//! launch shares is in `launch.rs`, one file per kernel family beside it.

mod attention;
mod attention_ring;
mod focus;
mod fp8;
mod fp8_gemm;
mod fused;
mod gemm_workspace;
mod launch;
mod moe;
mod rows;
mod split_k;

pub use attention::{paged_attention, paged_attention_into, qkv_rope_paged_attention, AttentionInto};
pub use attention_ring::attention_scratch_len;
pub use focus::focus_importance;
pub use fp8::{e4m3_from_f32, e4m3_to, fp8_linear, fp8_linear_max_rows, fp8_linear_partials, quantize_rows, WeightScale, FP8_MAX_ROWS, FP8_MMA_MAX_ROWS};
pub use fp8_gemm::{fp8_gemm_serves, fp8_w8a8_linear, fp8_w8a8_quantized, prepare_fp8_gemm};
pub use fused::{
    add_rms_norm, add_rms_norm_into, post_norm_into, qkv_bias_rope_i_write, qkv_norm_rope_write, qkv_rope_write, qkv_rope_write_into, residual_add,
    residual_add_rms_norm_into, rms_norm, rms_norm_into, rope_angles, rope_angles_into, silu_mul, silu_mul_into,
};
pub use gemm_workspace::{GemmWorkspace, GEMM_WORKSPACE_BYTES};
pub use launch::sm_count;
pub use moe::{fp8_experts_serve, moe_experts, moe_route, router_logits};
pub use rows::{
    compact_rows, copy_rows_in_place, gather_rows_into, gather_rows_scaled_into, greedy_confidence, greedy_flagged, greedy_flagged_into, latent_change,
    latent_change_into, row_dot_f32_into, scatter_rows,
};
pub use split_k::{linear_into, linear_partials, linear_partials_into, norm_of_partials, norm_of_partials_into};
