"""How the benchmark scripts find this checkout's examples/ and a dptc that works.

A script's own folder (benchmarks/) is first on sys.path, so each script imports this module
and calls put_checkout_on_path() before it imports dptc or examples.

The checkout root goes first on sys.path, for examples/.  Its dptc is the one to run when its
extension is built here (pip install -e ., or setup.py build_ext --inplace).  After a plain
pip install . it is not: the source tree has no _C and would shadow the installed dptc, so
the installed one is imported first and stays in sys.modules.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["ROOT", "extension_built", "put_checkout_on_path"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extension_built():
    """Whether dptc/_C is built inside this checkout."""
    package = os.path.join(ROOT, "dptc")
    return any(os.path.exists(os.path.join(package, "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def put_checkout_on_path():
    if ROOT in sys.path:
        return
    if not extension_built() and importlib.util.find_spec("dptc") is not None:
        importlib.import_module("dptc")
    sys.path.insert(0, ROOT)
