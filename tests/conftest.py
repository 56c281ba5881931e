"""Shared pytest configuration for dptc's tests.

- The repo root goes on sys.path, so `tests._launch` and `tests.workers_*` import the same way
  in pytest as in the rank processes (python -m pytest and plain pytest alike).
- `impl` is the implementation a test body runs against: "torch" (torch.distributed on gloo,
  the reference) or "dptc".  A test that only makes sense for dptc overrides it with
  @pytest.mark.parametrize("impl", ["dptc"]).  Nothing is skipped when dptc is missing: its
  cases fail with the import error.  Ranks receive the name and build the API themselves with
  tests._rank.load_impl(impl).
- The summary reports how the harness started its python processes: forked from the test
  zygote, or fresh and why (each fresh start imports torch again, seconds on this machine).
- Run the suite serially: the harness checks /dev/shm/dptc* around every run, and runs in
  parallel would see each other's segments.
"""

import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests._rank import IMPLS  # noqa: E402


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    """The implementation under test: "torch" or "dptc"."""
    return request.param


def pytest_terminal_summary(terminalreporter):
    from tests._launch import PYTHON_STARTS
    if PYTHON_STARTS:
        terminalreporter.write_line("python processes: " + "; ".join(
            f"{count} {how}" for how, count in PYTHON_STARTS.most_common()))
