"""Which NCCL and CUDA runtime dptc loads, when a CUDA tensor first reaches it.

dptc builds and imports without CUDA: csrc/cudalib.c loads the two libraries with dlopen the
first time a CUDA tensor meets dptc (see [Note: loading NCCL and the CUDA runtime] in
csrc/cudalib.h), never at import.  This module picks the files, for each library the first of:

1. ``$DPTC_NCCL_LIBRARY`` / ``$DPTC_CUDART_LIBRARY``, as given (a missing file is an error
   naming it: an explicit choice is never second-guessed);
2. the copy already mapped into this process: torch's CUDA build loads both at import, and
   sharing its copy keeps one NCCL and one CUDA runtime per process;
3. the nvidia wheels torch's CUDA builds install, on sys.path
   (``nvidia/nccl/lib/libnccl.so.2``, ``nvidia/cuda_runtime/lib/libcudart.so.12``);
4. the plain soname, for the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).

The first load decides, for the life of the process; a failure is remembered and raised again
as ``dptc.CudaLibraryError``, whose message names the file (or the missing function) and the
remedy.
"""

import os
import re
import sys
from typing import NamedTuple

from . import _C

__all__ = ["NCCL_ENV", "CUDART_ENV", "Choice", "find_nccl", "find_cudart", "load", "libraries",
           "nccl_version_text", "cuda_version_text"]

NCCL_ENV = "DPTC_NCCL_LIBRARY"
CUDART_ENV = "DPTC_CUDART_LIBRARY"

# Where the nvidia wheels put the libraries, relative to a sys.path entry (site-packages).
_NCCL_WHEEL_FILES = ("nvidia/nccl/lib/libnccl.so.2",)
_CUDART_WHEEL_FILES = ("nvidia/cuda_runtime/lib/libcudart.so.12",
                       "nvidia/cu13/lib/libcudart.so.13")
# File names of a loaded copy: the soname, or a bundled copy with a hash (libcudart-1a2b3c4d.so.12).
_NCCL_LOADED = re.compile(r"libnccl(-[0-9a-f]{8})?\.so(\.\d+)*")
_CUDART_LOADED = re.compile(r"libcudart(-[0-9a-f]{8})?\.so(\.\d+)*")

# Paths chosen by the first load(), with where each came from.
_chosen = {}


class Choice(NamedTuple):
    path: str      # what dlopen is given
    source: str    # why this one, for reports


def _mapped_library(pattern):
    """The first file mapped into this process whose name matches pattern, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    path = fields[5].rstrip("\n")
                    if pattern.fullmatch(os.path.basename(path)) and os.path.exists(path):
                        return path
    except OSError:
        pass
    return None


def _wheel_library(relative_paths):
    for entry in sys.path:
        for relative in relative_paths:
            path = os.path.join(entry or os.getcwd(), relative)
            if os.path.isfile(path):
                return path
    return None


def _find(env, pattern, wheel_files, soname):
    value = os.environ.get(env)
    if value:
        return Choice(value, f"${env}")
    path = _mapped_library(pattern)
    if path:
        return Choice(path, "already loaded in this process")
    path = _wheel_library(wheel_files)
    if path:
        return Choice(path, "nvidia wheel on sys.path")
    return Choice(soname, "the dynamic loader's search path")


def find_nccl():
    """The NCCL to load (see the module's docstring for the order)."""
    return _find(NCCL_ENV, _NCCL_LOADED, _NCCL_WHEEL_FILES, "libnccl.so.2")


def find_cudart():
    """The CUDA runtime to load: its soname follows torch's CUDA version (12 by default)."""
    cuda = _torch_cuda_version()
    soname = f"libcudart.so.{cuda.split('.')[0]}" if cuda else "libcudart.so.12"
    return _find(CUDART_ENV, _CUDART_LOADED, _CUDART_WHEEL_FILES, soname)


def _torch_cuda_version():
    torch = sys.modules.get("torch")
    return getattr(getattr(torch, "version", None), "cuda", None)


def load():
    """Loads NCCL and the CUDA runtime (once per process) and returns :func:`libraries`.

    Raises dptc.CudaLibraryError naming every library that could not be loaded.
    """
    if not _chosen:
        _chosen["nccl"], _chosen["cudart"] = find_nccl(), find_cudart()
    _C.load_cuda(_chosen["nccl"].path, _chosen["cudart"].path)
    return libraries()


def libraries():
    """What loading found, without loading: for "nccl" and "cudart", a dict of state
    ("untried", "loaded", "failed"), path, source (why that path), version (the library's
    code), version_text, error, and for "cudart" driver_version and driver_version_text."""
    found = _C.cuda_libraries()
    for name, info in found.items():
        choice = _chosen.get(name)
        info["source"] = choice.source if choice and info["state"] != "untried" else None
        text = nccl_version_text if name == "nccl" else cuda_version_text
        info["version_text"] = text(info["version"])
        if name == "cudart":
            info["driver_version_text"] = cuda_version_text(info["driver_version"])
    return found


def nccl_version_text(code):
    """NCCL's version code as text: 22703 -> "2.27.3" (before 2.9: 2708 -> "2.7.8")."""
    if code is None:
        return None
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def cuda_version_text(code):
    """A CUDA runtime or driver version as text: 12080 -> "12.8"; 0 (no driver) -> None."""
    if not code:
        return None
    return f"{code // 1000}.{code % 1000 // 10}"
