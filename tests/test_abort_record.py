"""A peer never reads a half-written abort reason ([Note: abort record] in csrc/shm.c).

Layer: one process, no Python in it.  tests/c/abort_record.c aborts a one-rank shared-memory
group; gdb runs it and executes the aborting rank's shm_abort one instruction at a time
(tests/scripts/abort_record_gdb.py), reading the segment's abort record after each as a peer
would.  A peer on another core may read the record between any two instructions, so checking
after every one covers every interleaving of the writer's program order: whenever the status
is published, the whole reason must already be there.  Publishing the status before writing
the reason fails this test at the instruction that publishes it.
"""

import json
import os
import shutil
import subprocess

import pytest

from tests._cc import c_compiler
from tests._launch import REPO_ROOT

SOURCES = [REPO_ROOT / "tests" / "c" / name for name in ("abort_record.c", "no_bridge.c")] + [
    REPO_ROOT / "csrc" / name for name in ("engine.c", "shm.c", "kernels.c", "common.c")]
# The extension's optimisation level (setup.py), so the compiler may reorder as it does there.
FLAGS = ["-std=c11", "-O2", "-g", "-D_GNU_SOURCE", "-pthread", "-Wall", "-Wextra", "-Werror"]
GDB_SCRIPT = REPO_ROOT / "tests" / "scripts" / "abort_record_gdb.py"
TIMEOUT_S = 120
# Longer than a cache line, shorter than the record's REASON_MAX.
REASON = "abort_record: " + "the reason, written whole before the status is published; " * 5


def test_the_status_is_published_after_the_whole_reason(tmp_path):
    compiler = c_compiler("build tests/c/abort_record.c")
    gdb = shutil.which("gdb")
    if gdb is None:
        pytest.skip("gdb is not installed (apt-get install gdb); it steps the aborting rank")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DPTC_SHM")}
    program = tmp_path / "abort_record"
    built = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-lrt", "-o", str(program)],
                           capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert built.returncode == 0, built.stderr
    done = subprocess.run([gdb, "-batch", "-nx", "-x", str(GDB_SCRIPT), "--args", str(program),
                           REASON], capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                          cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines and "ptrace" in done.stdout + done.stderr:
        pytest.skip(f"gdb cannot trace a process here: {done.stderr.strip()[-200:]}")
    assert lines, f"gdb printed no result ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    result = json.loads(lines[-1])
    assert result["expected"] == REASON, result
    assert result["published_at"] is not None, result      # the status appeared inside it
    assert result["violations"] == [], result
    assert result["final_reason"] == REASON, result
