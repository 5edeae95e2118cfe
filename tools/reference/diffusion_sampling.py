#!/usr/bin/env python3
"""The diffusion families' samplers at temperature > 0, in float64, written from the released
`generate` functions (../../shared/spec/diffusion-lms-and-focus.md §3, llada2.md §4), not from
Ponder's Rust code. The decode-loop references call `sample` for every masked position a step
reads out.

- "gumbel" (LLaDA `generate`): x0 = argmax(logits + T·Gumbel) — a draw from softmax(logits / T);
  confidence from the untempered softmax (`low_confidence`: its probability of x0). LLaDA's
  sampler has no top-k / top-p; given, they cut the tempered distribution top-k first.
- "k_then_p" (SDAR and LLaDA2.0 `sample_with_temperature_topk_topp`): logits / T, top-k, then
  top-p over the renormalised survivors; x0 drawn from the result, confidence its probability.
- "p_then_k" (Dream `sample_tokens`): logits / T, top-p over the full distribution, then top-k;
  confidence (its probability of x0, top-1 − top-2, or Σ p·ln(p + 1e-10)) on the result.

A cut keeps every token tied with its last survivor; top-p keeps the smallest set of most
probable tokens whose mass reaches p.

The randomness is the engine's, so a decode can be compared token for token: one uniform number
per read-out position, `uniform(key, step, position)`, hashed (SplitMix64's finaliser) from the
request's key (`mix(seed)`), the request's denoising steps before this one and the cache position
of the logits read; x0 is the first vocabulary index whose prefix mass exceeds u × the kept mass
(the Gumbel-max draw has the same distribution, with V uniforms instead of one).
"""
import numpy as np

M64 = (1 << 64) - 1


def mix(z):
    """SplitMix64's finaliser."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform(key, step, position):
    h = mix(mix(mix(key) ^ step) ^ position)
    return (h >> 40) / float(1 << 24)


class Draw:
    """A request's sampling parameters; `key` from its seed as the engine derives it."""

    def __init__(self, temperature, top_k=None, top_p=None, seed=0, sampler=None):
        self.temperature, self.top_k, self.top_p, self.key = temperature, top_k, top_p, mix(seed)
        # Another family's sampler instead of the model's own (the fixtures' wrong-rule check).
        self.sampler = sampler


def _cut(values, goal_of):
    """The smallest threshold set of `values` (most probable first, ties kept) whose measure
    reaches the goal; returns (keep mask, margin: how far the cut was from moving)."""
    order = np.sort(values)[::-1]
    cum = np.cumsum(order)
    goal = goal_of(cum[-1])
    c = min(int(np.searchsorted(cum, goal, side="left")), len(order) - 1)  # first prefix reaching it
    t = order[c]
    margin = cum[c] - goal
    if c > 0:
        margin = min(margin, goal - cum[c - 1])
    return values >= t, abs(margin)


def sample(logits, draw, step, position, sampler, order="maskgit_plus"):
    """(x0, confidence, margin) for float64 `logits` `[vocab]` (−inf at the mask token)."""
    l = logits - logits.max()
    q = np.exp(l / draw.temperature)
    q /= q.sum()
    v = len(q)
    margins = []
    k = min(draw.top_k or v, v)
    srt = np.sort(q)[::-1]
    keep_k = q >= srt[k - 1]
    if k < v:
        margins.append(srt[k - 1] - srt[k])
    p = draw.top_p if draw.top_p is not None else 1.0
    if sampler in ("gumbel", "k_then_p"):
        source = np.where(keep_k, q, 0.0)
    elif sampler == "p_then_k":
        source = q
    else:
        raise ValueError(sampler)
    if p < 1.0:
        keep_p, m = _cut(source, lambda mass: p * mass)
        margins.append(m)
    else:
        keep_p = np.ones(v, dtype=bool)
    kept = np.where(keep_k & keep_p, q, 0.0)
    mass = kept.sum()
    cum = np.cumsum(kept)
    target = uniform(draw.key, step, position) * mass
    x0 = int(np.searchsorted(cum, target, side="right"))
    x0 = min(x0, v - 1)
    lower = cum[x0 - 1] if x0 > 0 else 0.0
    margins.append(min(target - lower, cum[x0] - target) / mass)
    if sampler == "gumbel":
        z = np.exp(l)
        dist = z / z.sum()
    else:
        dist = kept / mass
    if order == "maskgit_plus":
        conf = dist[x0]
    elif order == "topk_margin":
        top = np.sort(dist)
        conf = top[-1] - top[-2]
    elif order == "entropy":
        conf = float((dist * np.log(dist + 1e-10)).sum())
    else:
        raise ValueError(order)
    return x0, float(conf), float(min(margins))


def family_sampler(family):
    return {"llada": "gumbel", "dream": "p_then_k", "sdar": "k_then_p", "sdar_moe": "k_then_p", "llada2": "k_then_p"}[family]


def draw_of(case):
    """A fixture case's `sampling` entry as a Draw (None for greedy cases)."""
    s = case.get("sampling")
    return None if s is None else Draw(s["temperature"], s.get("top_k"), s.get("top_p"), s["seed"])


def clear_sampled_decode(decode, sampling, wrong, tries=200):
    """A sampled decode that decides nothing within MIN_MARGIN: `decode(draw, margins)` tried from
    `sampling["seed"]` upwards. Where both cuts are given, the decode under the `wrong` sampler
    must differ too, so the fixture tells the family's sampler apart. Returns (tokens, the
    sampling with the seed used, the smallest margin)."""
    from fixture_checks import MIN_MARGIN

    for seed in range(sampling["seed"], sampling["seed"] + tries):
        s = dict(sampling, seed=seed)
        args = (s["temperature"], s.get("top_k"), s.get("top_p"), seed)
        margins = []
        tokens = decode(Draw(*args), margins)
        if min(margins) <= MIN_MARGIN:
            continue
        if "top_k" in s and "top_p" in s and decode(Draw(*args, sampler=wrong), []) == tokens:
            continue
        return tokens, s, min(margins)
    raise RuntimeError(f"no seed in {tries} decides clearly (and tells the sampler apart): {sampling}")
