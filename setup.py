"""Build of dptc's C core: plain C11 against the Python C API (no torch, CUDA or NCCL headers;
NCCL and the CUDA runtime are loaded at run time)."""

import glob
import os

from setuptools import Extension, setup

extra_compile_args = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
                      "-fvisibility=hidden"]
extra_link_args = ["-pthread"]
if os.environ.get("DPTC_SANITIZE"):
    # DPTC_SANITIZE=1 pip install -e . ; see README "Sanitizers".
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1",
                "-fno-sanitize-recover=undefined"]
    extra_compile_args += sanitize
    extra_link_args += sanitize

setup(
    ext_modules=[
        Extension(
            "dptc._C",
            sources=sorted(glob.glob("csrc/*.c")),
            depends=sorted(glob.glob("csrc/*.h")),
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            # shm_open and dlopen (NCCL and the CUDA runtime are loaded at run time, never
            # linked: csrc/cudalib.c); both live in libc itself from glibc 2.34.
            libraries=["rt", "dl"],
            define_macros=[("_GNU_SOURCE", None)],
        )
    ],
)
