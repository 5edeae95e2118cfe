//! What the device can do at best, measured: bf16 matmul throughput and copy bandwidth — the
//! two ceilings the benchmarks' roofline and compute bounds divide by.

use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// bf16 matmul throughput (FLOP/s) on 8192² × 8192, median of 5 (the CPU: a small f32 one).
pub fn matmul_peak(device: &Device) -> candle_core::Result<f64> {
    let (n, dtype) = if device.is_cpu() { (256, DType::F32) } else { (8192, DType::BF16) };
    let a = Tensor::ones((n, n), dtype, device)?;
    let _ = a.matmul(&a)?;
    device.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let c = a.matmul(&a)?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        drop(c);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / times[2])
}

/// Device-to-device copy bandwidth (bytes read + written per second), median of 10.
pub fn copy_bandwidth(device: &Device) -> candle_core::Result<f64> {
    let n = if device.is_cpu() { 1 << 24 } else { 1 << 30 };
    let x = Tensor::ones(n, DType::BF16, device)?;
    let _ = x.copy()?;
    device.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let y = x.copy()?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        drop(y);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n * 2) as f64 / times[5])
}
