//! Seeded discrete distributions for replayed decisions (exit depths, unmask counts): an
//! exponentially tilted distribution with an exact mean, and draws keyed by hashing, so a
//! replayed decision depends on who asks, never on the batch it was asked in.

/// `p[i]` = P(value = i + 1) over `1..=hi`, zero below `lo`, ∝ e^{θ(v − mean)} with θ solved by
/// bisection so the mean is `mean` (values spread over the whole range). The caller checks
/// `lo..=hi` contains `mean`.
pub(crate) fn tilted(lo: usize, hi: usize, mean: f64) -> Vec<f64> {
    let dist = |theta: f64| -> Vec<f64> {
        let w: Vec<f64> = (1..=hi).map(|d| if d < lo { 0.0 } else { (theta * (d as f64 - mean)).exp() }).collect();
        let s: f64 = w.iter().sum();
        w.into_iter().map(|x| x / s).collect()
    };
    let (mut a, mut b) = (-50.0, 50.0);
    for _ in 0..200 {
        let mid = 0.5 * (a + b);
        if mean_of(&dist(mid)) < mean {
            a = mid;
        } else {
            b = mid;
        }
    }
    dist(0.5 * (a + b))
}

/// Expectation of the value under `probs` (values 1-based).
pub(crate) fn mean_of(probs: &[f64]) -> f64 {
    probs.iter().enumerate().map(|(i, p)| (i + 1) as f64 * p).sum()
}

/// The value (1-based) at the quantile that hashing `key` gives.
pub(crate) fn draw(probs: &[f64], key: u64) -> usize {
    let u = (key >> 11) as f64 / (1u64 << 53) as f64;
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return i + 1;
        }
    }
    probs.len()
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `z`.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
