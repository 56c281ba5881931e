"""The reduction kernels of csrc/kernels.c, checked in C with no torch and no
process group: tests/c/test_reduce.c is built with kernels.c and common.c
(dptc_fail, dtype names) alone and run.

It compares every dtype and op (AVG as SUM divided by n), 1 to 4 sources,
counts 0 to 20011 (two of kernels.c's blocks and a tail for every dtype), in
place and out of place, against references computed in double precision; see
the file's header for how they are computed.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sysconfig

import pytest

from tests._cc import c_compiler
ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "tests" / "c" / "test_reduce.c", ROOT / "csrc" / "kernels.c",
           ROOT / "csrc" / "common.c"]
# The extension's own warning flags and feature macro (setup.py).
WARNINGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE"]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
SANITIZED = ["-O1", "-g", "-fno-omit-frame-pointer", *SANITIZERS]
# "portable" builds only the baseline kernels, which other machines run
# (no AVX2 clones, no F16C float16 kernels); see kernels.c.
PORTABLE = ["-DDPTC_REDUCE_PORTABLE"]
BUILDS = {
    "O2": ["-O2"],
    "O2-portable": ["-O2", *PORTABLE],
    "sanitized": SANITIZED,
    "sanitized-portable": [*SANITIZED, *PORTABLE],
}
# Leak checking needs ptrace-free surroundings that containers do not always
# give; the test frees what it allocates and kernels.c allocates nothing.
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}
BUILD_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900


def _compiler():
    return c_compiler("run the reduction kernel tests")


def _environment():
    # tools/sanitize.sh preloads the sanitizer runtimes into every process;
    # the compiler and the plain builds of this test must not inherit that.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return {**env, **SANITIZER_ENV}


def _can_sanitize(cc, tmp_path):
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    built = subprocess.run([cc, *SANITIZERS, str(probe), "-o",
                            str(tmp_path / "probe")],
                           capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S, env=_environment())
    return built.returncode == 0


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_reduce_kernels(build, tmp_path):
    cc = _compiler()
    if build.startswith("sanitized") and not _can_sanitize(cc, tmp_path):
        pytest.skip(f"{cc} cannot link -fsanitize=address,undefined here")
    exe = tmp_path / "test_reduce"
    command = [cc, *WARNINGS, *BUILDS[build], "-I", str(ROOT / "csrc"),
               *(str(s) for s in SOURCES), "-o", str(exe), "-lm"]
    built = subprocess.run(command, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S, env=_environment())
    assert built.returncode == 0, (
        f"build failed: {' '.join(command)}\n{built.stdout}{built.stderr}")

    run = subprocess.run([str(exe)], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=_environment())
    assert run.returncode == 0, (
        f"test_reduce exited {run.returncode}\n{run.stdout}{run.stderr}")
    assert re.search(r", 0 failures$", run.stdout, re.MULTILINE), run.stdout


# GH200 nodes are aarch64: every x86-only construct (target_clones, F16C,
# pause) must sit behind an architecture test.  A cross compiler checks that
# here without an arm machine.  pyconfig.h is this machine's, which a syntax
# check tolerates.
AARCH64_CC = "aarch64-linux-gnu-gcc"


@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "csrc").glob("*.c")))
def test_sources_build_for_aarch64(source):
    cc = shutil.which(AARCH64_CC)
    if cc is None:
        pytest.skip(f"{AARCH64_CC} is not on PATH; install gcc-aarch64-linux-gnu "
                    "to check that csrc builds for aarch64")
    include = sysconfig.get_paths()["include"]
    command = [cc, *WARNINGS, "-fsyntax-only", "-I", include, "-I", str(ROOT / "csrc"),
               str(ROOT / "csrc" / source)]
    checked = subprocess.run(command, capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S, env=_environment())
    assert checked.returncode == 0, (
        f"aarch64 syntax check failed: {' '.join(command)}\n{checked.stderr}")
