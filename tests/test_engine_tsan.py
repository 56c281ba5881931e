"""engine.c and shm.c under ThreadSanitizer, and under AddressSanitizer with
UBSan, with no torch and no Python in the ranks: tests/c/test_engine.c is
built with engine.c, shm.c, kernels.c and common.c alone (bridge stubs in the
test file) and run.

It forks one-node groups of 2 and 3 rank processes; each rank drives both
streams from two threads at once (blocking and asynchronous collectives of
every kind, shared buffers made and used concurrently), aborts the group from
a third thread while the streams are busy, destroys groups with works
queued, and has every rank but 0 leave a group that rank 0 goes on using;
see the file's header.  Every result is checked exactly.
tools/tsan.sh does the same from the command line.
"""

import os
import pathlib
import platform
import re
import shutil
import subprocess

import pytest

from tests._cc import c_compiler
ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "tests" / "c" / "test_engine.c", ROOT / "tests" / "c" / "no_bridge.c"] + [
    ROOT / "csrc" / name for name in ("engine.c", "shm.c", "kernels.c", "common.c")]
FLAGS = ["-std=c11", "-O1", "-g", "-D_GNU_SOURCE", "-pthread", "-Wall", "-Wextra", "-Werror"]
# kernels.c's target_clones become ifunc resolvers, which the loader runs before
# the TSan runtime is initialised; instrumented, they crash at startup.  The
# portable build has no clones (the kernels are the same C loops).
TSAN = ["-fsanitize=thread", "-DDPTC_REDUCE_PORTABLE"]
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
BUILDS = {"tsan": TSAN, "asan": ASAN}
OPS_PER_STREAM = 160
DEADLINE_S = 60           # per group size, enforced by the program's parent (SIGKILL)
BUILD_TIMEOUT_S = 300
RUN_TIMEOUT_S = 2 * DEADLINE_S + 60
PROBE = """
#include <pthread.h>
static int x;
static void *touch(void *arg) { (void)arg; __atomic_fetch_add(&x, 1, __ATOMIC_SEQ_CST); return 0; }
int main(void) { pthread_t t; pthread_create(&t, 0, touch, 0); pthread_join(t, 0); return 0; }
"""


def _compiler():
    return c_compiler("run the engine sanitizer tests")


def _environment(**extra):
    # tools/sanitize.sh preloads the ASan runtime into every process; a TSan
    # binary cannot start with it, and this one needs no preloading.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.pop("DPTC_SHM", None)
    return {**env, **extra}


def _build(cc, flags, sources, exe):
    command = [cc, *FLAGS, *flags, *(str(s) for s in sources), "-lrt", "-o", str(exe)]
    return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env=_environment()), command


@pytest.fixture(scope="module")
def tsan_launcher(tmp_path_factory):
    """How to start a TSan program here: [] or setarch -R (ASLR off), or a skip."""
    cc = _compiler()
    tmp = tmp_path_factory.mktemp("tsan_probe")
    (tmp / "probe.c").write_text(PROBE)
    built, _ = _build(cc, ["-fsanitize=thread"], [tmp / "probe.c"], tmp / "probe")
    if built.returncode != 0:
        pytest.skip(f"{cc} cannot build with -fsanitize=thread here: "
                    f"{(built.stderr or built.stdout).strip()[-300:]}")
    launchers = [[]]
    if shutil.which("setarch"):
        # Older TSan runtimes abort on the mappings of a randomised high
        # address space ("unexpected memory mapping"); ASLR off avoids them.
        launchers.append(["setarch", platform.machine(), "-R"])
    tail = ""
    for launcher in launchers:
        ran = subprocess.run([*launcher, str(tmp / "probe")], capture_output=True, text=True,
                             timeout=60, env=_environment())
        if ran.returncode == 0:
            return launcher
        tail = (ran.stderr or ran.stdout).strip()[-300:]
    pytest.skip(f"ThreadSanitizer programs do not start here (also tried setarch -R): {tail}")


def _asan_leak_checking(cc, tmp):
    """Whether LeakSanitizer runs here (it needs ptrace-like access that some
    containers deny); skips when ASan programs cannot be built at all."""
    (tmp / "asan_probe.c").write_text("int main(void) { return 0; }\n")
    built, _ = _build(cc, ASAN, [tmp / "asan_probe.c"], tmp / "asan_probe")
    if built.returncode != 0:
        pytest.skip(f"{cc} cannot build with -fsanitize=address,undefined here: "
                    f"{(built.stderr or built.stdout).strip()[-300:]}")
    ran = subprocess.run([str(tmp / "asan_probe")], capture_output=True, text=True, timeout=60,
                         env=_environment(ASAN_OPTIONS="detect_leaks=1"))
    return ran.returncode == 0


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Builds on first use, per sanitizer: name -> (path, leak checking works)."""
    built = {}

    def get(name):
        if name not in built:
            cc = _compiler()
            tmp = tmp_path_factory.mktemp(f"engine_{name}")
            leaks = _asan_leak_checking(cc, tmp) if name == "asan" else False
            exe = tmp / "test_engine"
            result, command = _build(cc, BUILDS[name], SOURCES, exe)
            assert result.returncode == 0, (
                f"build failed: {' '.join(command)}\n{result.stdout}{result.stderr}")
            built[name] = (exe, leaks)
        return built[name]

    return get


def _run(command, env):
    run = subprocess.run([*command, str(OPS_PER_STREAM), str(DEADLINE_S)], capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"test_engine exited {run.returncode}\n{output}"
    # Two groups of 2 and 3 ranks: five rank processes, each reporting 0 failures.
    assert len(re.findall(r", 0 failures$", run.stdout, re.MULTILINE)) == 5, output
    assert "test_engine: 0 rank processes failed" in run.stdout, output
    return output


def test_engine_under_thread_sanitizer(programs, tsan_launcher):
    exe, _ = programs("tsan")
    output = _run([*tsan_launcher, str(exe)],
                  _environment(TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"))
    assert "WARNING: ThreadSanitizer" not in output, output
    assert "ThreadSanitizer:" not in output, output


@pytest.mark.parametrize("segments", ["memfd", "posix"])
def test_engine_under_address_sanitizer(programs, segments):
    exe, leaks = programs("asan")
    env = _environment(ASAN_OPTIONS=f"detect_leaks={int(leaks)}:halt_on_error=1",
                       UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    if segments == "posix":
        env["DPTC_SHM"] = "posix"   # /dev/shm names instead of memfd (see shm.c)
    output = _run([str(exe)], env)
    for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"):
        assert marker not in output, output
