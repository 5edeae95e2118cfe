//! How Huginn's recurrent state starts for each token (spec §3.2 step 3).

use candle_core::{DType, Device, Tensor};

/// The loop state s0 a token's recurrence starts from.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum InitialState {
    /// s0 = 0: how the CDB authors serve Huginn, and the default.
    #[default]
    Zeros,
    /// Upstream's `initialize_state`: a truncated normal with σ = `scale`·sqrt(2 / (5h)), cut at
    /// ±3σ, times sqrt(h) (effective std `scale`·sqrt(0.4)). Upstream draws it from a global RNG
    /// per call; here it is a fixed function of (`seed`, absolute position, element), so batched
    /// and sequential runs see the same state and a run is reproducible. `scale` 0 is `Zeros`.
    TruncatedNormal { scale: f64, seed: u64 },
}

impl InitialState {
    /// Checks the scale (finite, ≥ 0).
    pub fn validate(&self) -> crate::Result<()> {
        match *self {
            InitialState::TruncatedNormal { scale, .. } if !(scale.is_finite() && scale >= 0.0) => {
                Err(crate::Error::InvalidOption(format!("initial-state scale {scale} must be finite and >= 0")))
            }
            _ => Ok(()),
        }
    }

    /// The state of every position below `positions` as a `[positions, hidden]` table in `dtype`
    /// (`None` for a zero state). Built once per model; the prelude gathers its rows by position.
    /// A table of more than 2^30 values (`MAX_TABLE_ELEMS`) is a typed error.
    pub fn table(&self, positions: usize, hidden: usize, dtype: DType, device: &Device) -> crate::Result<Option<Tensor>> {
        let (scale, seed) = match *self {
            InitialState::TruncatedNormal { scale, seed } if scale > 0.0 => (scale, seed),
            _ => return Ok(None),
        };
        let elems = positions.checked_mul(hidden).filter(|&n| n <= MAX_TABLE_ELEMS);
        let Some(elems) = elems else {
            return Err(crate::Error::InvalidOption(format!(
                "an initial-state table of {positions} positions x {hidden} would exceed {MAX_TABLE_ELEMS} values (the checkpoint's context is too long for a non-zero initial state)"
            )));
        };
        let sigma = scale * (2.0 / (5.0 * hidden as f64)).sqrt();
        let gain = (hidden as f64).sqrt();
        let values: Vec<f32> = (0..elems).map(|e| (truncated_normal(seed, e as u64) * sigma * gain) as f32).collect();
        Ok(Some(Tensor::from_vec(values, (positions, hidden), device)?.to_dtype(dtype)?))
    }
}

/// Most values an initial-state table may hold (4 GiB in f32): Huginn-0125's 4096 positions x
/// 5280 are 21.6 M; a config whose context makes the table larger would exhaust memory first.
pub const MAX_TABLE_ELEMS: usize = 1 << 30;

/// splitmix64: a counter-based generator, stable across platforms and library versions.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A standard normal cut at ±3 (rejection, Box–Muller) for element `e` of stream `seed`.
fn truncated_normal(seed: u64, e: u64) -> f64 {
    let base = mix(seed ^ mix(e));
    for attempt in 0u64.. {
        let a = mix(base.wrapping_add(2 * attempt));
        let b = mix(base.wrapping_add(2 * attempt + 1));
        let u1 = ((a >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        if z.abs() <= 3.0 {
            return z;
        }
    }
    unreachable!("the loop returns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_normal_has_upstream_scale_and_cut() {
        let h = 64;
        let t = InitialState::TruncatedNormal { scale: 1.0, seed: 3 }.table(256, h, DType::F32, &Device::Cpu).unwrap().unwrap();
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        // Effective std sqrt(0.4) ≈ 0.632 before the cut; a ±3σ cut lowers it by ~1.4 %.
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((std - 0.4f64.sqrt() * 0.986).abs() < 0.02, "std {std}");
        let cut = 3.0 * 0.4f64.sqrt();
        assert!(v.iter().all(|&x| (x as f64).abs() <= cut + 1e-6), "values beyond ±3σ·sqrt(h)");
        assert!(v.iter().any(|&x| (x as f64).abs() > 0.8 * cut), "the tails are reached");
    }

    #[test]
    fn deterministic_per_seed_and_zero_when_off() {
        let mk = |s: InitialState| s.table(8, 16, DType::F32, &Device::Cpu).unwrap();
        let a = mk(InitialState::TruncatedNormal { scale: 1.0, seed: 1 }).unwrap();
        let b = mk(InitialState::TruncatedNormal { scale: 1.0, seed: 1 }).unwrap();
        let c = mk(InitialState::TruncatedNormal { scale: 1.0, seed: 2 }).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&a), flat(&b));
        assert_ne!(flat(&a), flat(&c));
        assert!(mk(InitialState::Zeros).is_none());
        assert!(mk(InitialState::TruncatedNormal { scale: 0.0, seed: 1 }).is_none());
        assert!(InitialState::TruncatedNormal { scale: f64::NAN, seed: 1 }.validate().is_err());
        assert!(InitialState::TruncatedNormal { scale: -1.0, seed: 1 }.validate().is_err());
    }

    #[test]
    fn a_table_past_its_bound_is_an_error_not_an_allocation() {
        let on = InitialState::TruncatedNormal { scale: 1.0, seed: 1 };
        for (positions, hidden) in [(1 << 40, 5280), (usize::MAX, 2), (MAX_TABLE_ELEMS + 1, 1)] {
            assert!(matches!(on.table(positions, hidden, DType::F32, &Device::Cpu), Err(crate::Error::InvalidOption(_))));
        }
        assert!(InitialState::Zeros.table(usize::MAX, 2, DType::F32, &Device::Cpu).unwrap().is_none());
    }
}
