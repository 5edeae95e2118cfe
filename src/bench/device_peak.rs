//! What the device can do at best, measured: bf16 matmul throughput, the FP8 linear layers'
//! throughput and copy bandwidth — the ceilings the benchmarks' roofline and compute bounds
//! divide by.

use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// What a bf16 GEMM reaches on this device, two ways (FLOP/s).
#[derive(Clone, Copy, Debug)]
pub struct MatmulPeak {
    /// Sustained on random normal data, after a second of GEMMs: the power-limited clock every
    /// benchmark run (random weights, seconds long) meets. The ceiling the bounds divide by.
    pub sustained: f64,
    /// The median of the first five GEMMs on all-ones matrices, the ceiling bounds divided by
    /// before `sustained`: tensor cores on constant data draw little power, so a cool GPU runs
    /// them at boost clock (840–890 TFLOP/s on an H200, a rate no run holds); right after a
    /// bench has generated its weights it reads 610–740. Kept for comparison only.
    pub burst_ones: f64,
}

impl MatmulPeak {
    /// `{"matmul_peak_tflops" (sustained), "matmul_peak_ones_burst_tflops"}` for a benchmark's JSON.
    pub fn json_fields(&self) -> [(&'static str, f64); 2] {
        [("matmul_peak_tflops", self.sustained / 1e12), ("matmul_peak_ones_burst_tflops", self.burst_ones / 1e12)]
    }
}

impl std::fmt::Display for MatmulPeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.0} TFLOP/s sustained on random data ({:.0} in a burst on ones)", self.sustained / 1e12, self.burst_ones / 1e12)
    }
}

/// Measures [`MatmulPeak`] on 8192² × 8192 bf16 (the CPU: 256² f32, briefly).
pub fn matmul_peak(device: &Device) -> candle_core::Result<MatmulPeak> {
    let (n, dtype, warm_s) = if device.is_cpu() { (256, DType::F32, 0.05) } else { (8192, DType::BF16, 1.0) };
    let flops = 2.0 * (n as f64).powi(3);
    let ones = Tensor::ones((n, n), dtype, device)?;
    let _ = ones.matmul(&ones)?;
    device.synchronize()?;
    // Products are freed as they come (`map(drop)`): a sample then maps one fresh 128 MiB
    // product, small against its GEMMs (≈ 1.6 ms each).
    let burst_ones = flops / median_seconds(device, 5, 1, || ones.matmul(&ones).map(drop))?;
    let random = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let warm = Instant::now();
    while warm.elapsed().as_secs_f64() < warm_s {
        for _ in 0..20 {
            let _ = random.matmul(&random)?;
        }
        device.synchronize()?;
    }
    let sustained = flops / median_seconds(device, 5, 20, || random.matmul(&random).map(drop))?;
    Ok(MatmulPeak { sustained, burst_ones })
}

/// What a W8A8 FP8 linear layer reaches on this device (FLOP/s): `x Wᵀ` for x `[8192, 8192]`
/// bf16 and W `[8192, 8192]` E4M3 through [`crate::ops::fp8_matmul`] under `fp8=w8a8` — the
/// activations' quantization included, as every W8A8 layer runs it — sustained on random data
/// after a second of them, as [`MatmulPeak::sustained`]. `None` off CUDA, where no FP8 GEMM runs.
pub fn fp8_linear_peak(device: &Device) -> candle_core::Result<Option<f64>> {
    if !device.is_cuda() {
        return Ok(None);
    }
    let n = 8192;
    let flops = 2.0 * (n as f64).powi(3);
    let w = crate::quant::Fp8Weight::quantize(&Tensor::randn(0f32, 1.0, (n, n), device)?)?;
    let x = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?;
    let policy = crate::ops::KernelPolicy { fp8: crate::ops::Fp8Kernels::W8A8, ..Default::default() };
    let (peak, counts) = crate::ops::with_kernels(policy, || -> candle_core::Result<f64> {
        let warm = Instant::now();
        while warm.elapsed().as_secs_f64() < 1.0 {
            for _ in 0..20 {
                let _ = crate::ops::fp8_matmul(&x, &w, None)?;
            }
            device.synchronize()?;
        }
        Ok(flops / median_seconds(device, 5, 20, || crate::ops::fp8_matmul(&x, &w, None).map(drop))?)
    });
    if counts.fp8_w8a8 == 0 {
        candle_core::bail!("fp8_linear_peak: the FP8 GEMM did not run on {device:?}");
    }
    peak.map(Some)
}

/// Median over `samples` of the seconds one `op` takes, timed `per_sample` back to back with the
/// device synchronised at each sample's end. What `op` returns is kept until after that
/// synchronisation: the stream-ordered pool hands freed memory back to the driver when the
/// device is synchronised, so an output freed earlier makes the next sample time mapping fresh
/// memory (for a copy that is most of its time).
fn median_seconds<T>(device: &Device, samples: usize, per_sample: usize, op: impl Fn() -> candle_core::Result<T>) -> candle_core::Result<f64> {
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        let outputs = (0..per_sample).map(|_| op()).collect::<candle_core::Result<Vec<T>>>()?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / per_sample as f64);
        drop(outputs);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[samples / 2])
}

/// Device-to-device copy bandwidth (bytes read + written per second), median of 10.
pub fn copy_bandwidth(device: &Device) -> candle_core::Result<f64> {
    let n = if device.is_cpu() { 1 << 24 } else { 1 << 30 };
    let x = Tensor::ones(n, DType::BF16, device)?;
    // Warm-up, its copy freed only after the synchronise so the first sample reuses its memory.
    let warm = x.copy()?;
    device.synchronize()?;
    drop(warm);
    Ok(2.0 * (n * 2) as f64 / median_seconds(device, 10, 1, || x.copy())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_are_positive_rates() {
        let cpu = Device::Cpu;
        let peak = matmul_peak(&cpu).unwrap();
        assert!(peak.sustained.is_finite() && peak.sustained > 0.0, "{peak:?}");
        assert!(peak.burst_ones.is_finite() && peak.burst_ones > 0.0, "{peak:?}");
        let [(sustained_key, sustained), (burst_key, burst)] = peak.json_fields();
        assert_eq!((sustained_key, sustained), ("matmul_peak_tflops", peak.sustained / 1e12));
        assert_eq!((burst_key, burst), ("matmul_peak_ones_burst_tflops", peak.burst_ones / 1e12));
        assert!(peak.to_string().contains("sustained on random data"), "{peak}");
        let bw = copy_bandwidth(&cpu).unwrap();
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
    }
}
