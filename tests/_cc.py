"""The C compiler the tests build their helper programs and libraries with."""

import os
import shutil

import pytest

__all__ = ["c_compiler"]


def c_compiler(purpose: str) -> str:
    """The path of $CC, else of cc, gcc or clang; skips the test, naming `purpose` (what the
    compiler was for), when none is installed."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = name and shutil.which(name)
        if path:
            return path
    pytest.skip(f"no C compiler found; install gcc or set CC to {purpose}")
