"""Comparisons of generate() outputs shared by the engine tests."""

LOGPROB_TOL = 1e-4  # float32 rounding: a step's batch (and so its reductions) may differ between the runs compared


def assert_logprobs_close(a: list[dict] | None, b: list[dict] | None):
    """Two runs' per-token logprob dicts: as many, the same token ids each, values within LOGPROB_TOL."""
    a, b = a or [], b or []
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < LOGPROB_TOL for t in x), (x, y)
