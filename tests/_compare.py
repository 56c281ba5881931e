"""The one comparison of results the tests make: the largest relative difference."""

import torch

__all__ = ["max_rel"]


def max_rel(actual, expected) -> float:
    """max over pairs of max|a - e| / max|e|, in float64; where e is all zeros, the plain
    max|a - e| (a relative difference has no scale there, and dividing by a tiny one would turn
    rounding into a failure).  actual and expected are dicts with the same keys or sequences
    of the same length, paired by key or position; each value is a tensor, a number or a
    (nested) list of numbers, the two of a pair the same size (a pair of zero-size values
    counts 0)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), \
            (sorted(actual), sorted(expected))
        pairs = [(name, actual[name], want) for name, want in expected.items()]
    else:
        actual, expected = list(actual), list(expected)
        assert len(actual) == len(expected), (len(actual), len(expected))
        pairs = list(zip(range(len(expected)), actual, expected))
    worst = 0.0
    for name, got, want in pairs:
        got, want = _float64(got), _float64(want)
        assert got.numel() == want.numel(), (name, tuple(got.shape), tuple(want.shape))
        if want.numel() == 0:
            continue
        diff = (got.reshape(-1) - want.reshape(-1)).abs().max().item()
        scale = want.abs().max().item()
        worst = max(worst, diff / scale if scale else diff)
    return worst


def _float64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.as_tensor(value, dtype=torch.float64)
