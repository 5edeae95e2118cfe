"""Checks the fixture makers run on what they record."""


def wrong_rule_shows(decode, fixture) -> bool:
    """Whether a decode under a deliberately wrong rule — `(tokens, steps per token,
    log-probabilities)` — differs from the fixture's by more than the parity tests tolerate:
    other tokens or steps, or a log-probability off by more than 1e-4 relative. A fixture none of
    whose decodes shows the wrong rule would not catch the engine making that mistake."""
    tokens, depths, logprobs = decode
    if (tokens, depths) != (fixture["tokens"], fixture["depths"]):
        return True
    return any(abs(a - b) > 1e-4 * (1 + abs(b)) for a, b in zip(logprobs, fixture["logprobs"]))
