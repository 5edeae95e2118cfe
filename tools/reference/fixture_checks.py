"""Checks the fixture makers run on what they record."""

# Every decision of a fixture decode (a probability gap, cdf against q, a latent difference
# against its threshold) is at least this far from going the other way, far above the f32
# engine's error, so the engine must reproduce the decode exactly.
MIN_MARGIN = 1e-4


def clearly_decided(margins, label) -> bool:
    """Whether a decode's closest decision (`margins`, as the references append them) is beyond
    MIN_MARGIN; if not, says which decode is left out."""
    if min(margins) > MIN_MARGIN:
        return True
    print(f"skipped {label}: a decision within {min(margins):.1e}")
    return False


def wrong_rule_shows(decode, fixture) -> bool:
    """Whether a decode under a deliberately wrong rule — `(tokens, steps per token,
    log-probabilities)` — differs from the fixture's by more than the parity tests tolerate:
    other tokens or steps, or a log-probability off by more than 1e-4 relative. A fixture none of
    whose decodes shows the wrong rule would not catch the engine making that mistake."""
    tokens, depths, logprobs = decode
    if (tokens, depths) != (fixture["tokens"], fixture["depths"]):
        return True
    return any(abs(a - b) > 1e-4 * (1 + abs(b)) for a, b in zip(logprobs, fixture["logprobs"]))
