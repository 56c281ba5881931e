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
- The tests run this checkout's dptc (the repo root comes first on every path), so a session
  in a checkout whose extension is not built here (a plain `pip install .`, or none) stops at
  once with the remedy, rather than failing every test with the same ImportError, or, beside
  an editable install of another checkout, running this tree's Python over that one's C core
  (the import system finds dptc._C there).  Built here means dptc/_C*.so, as
  benchmarks/_checkout.py has it: `pip install -e .` (not editable_mode=strict) or
  `setup.py build_ext --inplace`.
"""

import importlib.machinery
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests._rank import IMPLS  # noqa: E402


def pytest_sessionstart(session):
    package = Path(REPO_ROOT) / "dptc"
    if not any((package / ("_C" + suffix)).exists()
               for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        pytest.exit(f"dptc's C extension is not built in {package}, and the tests run this "
                    f"checkout's dptc, not an installed one: build it here with "
                    f"pip install --no-build-isolation -e . (README's test command) or "
                    f"python setup.py build_ext --inplace", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    """The implementation under test: "torch" or "dptc"."""
    return request.param


def pytest_terminal_summary(terminalreporter):
    from tests._launch import PYTHON_STARTS
    if PYTHON_STARTS:
        terminalreporter.write_line("python processes: " + "; ".join(
            f"{count} {how}" for how, count in PYTHON_STARTS.most_common()))
