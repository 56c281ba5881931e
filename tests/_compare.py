"""Comparisons of the parameter dicts ranks report as JSON ({name: flat list of floats})."""

__all__ = ["max_rel"]


def max_rel(actual, expected):
    """max over names of max|a - e| / max|e| (1e-30 where e is all zeros or empty); the two
    dicts must hold the same names, each the same number of values."""
    worst = 0.0
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name, want in expected.items():
        got = actual[name]
        assert len(got) == len(want), name
        scale = max((abs(v) for v in want), default=0.0) or 1e-30
        worst = max(worst, max((abs(a - b) for a, b in zip(got, want)), default=0.0) / scale)
    return worst
