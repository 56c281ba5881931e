"""dptc under a 64 MiB /dev/shm, Docker's default.

Each test runs tests/scripts/small_shm.py on 2 ranks with torchrun --standalone inside a private
mount namespace (`unshare -m`) whose /dev/shm is a fresh 64 MiB tmpfs, so the host's /dev/shm is
never touched.  Needs root (or CAP_SYS_ADMIN) for unshare and mount; skipped otherwise.

- memfd segments (the default) are not limited by /dev/shm: 256 MiB collectives are exact and a
  DDP step with buckets over 64 MiB matches single-process training.
- DPTC_SHM=posix puts the same buckets in /dev/shm: every rank fails with an error that names
  /dev/shm and the remedy, and no process dies by a signal (no SIGBUS at first touch).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests._launch import REPO_ROOT, _ProcessTree

TIMEOUT_S = 90
NPROC = 2
SCRIPT = "tests/scripts/small_shm.py"
LINE = re.compile(r"^SMALL_SHM rank=(\d+) (\{.*\})$", re.MULTILINE)


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root to mount a private 64 MiB /dev/shm (unshare -m)"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare -m true failed: {error}"
    if probe.returncode != 0:
        return (f"unshare -m true failed (no mount namespaces here, e.g. an unprivileged "
                f"container): {probe.stderr.decode(errors='replace').strip()}")
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def run_small_shm(mode, extra_env=None):
    """Runs the script on NPROC ranks under a 64 MiB /dev/shm; returns (returncode, output,
    {rank: record}).  The whole process tree is killed on timeout or error."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "DPTC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "DPTC_TIMEOUT": "30",
                "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    env.update(extra_env or {})
    inner = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -m "
             f"torch.distributed.run --standalone --nproc_per_node={NPROC} {SCRIPT} "
             f"--mode {mode}")
    tree = _ProcessTree()  # start_new_session=True; also records torchrun's workers, which
    # torchrun starts in sessions of their own, out of reach of a process group kill
    proc = None
    with tempfile.TemporaryFile() as out:
        try:
            proc = tree.start(["unshare", "-m", "sh", "-c", inner], cwd=REPO_ROOT, env=env,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                tree.refresh()
                time.sleep(0.05)
            timed_out = proc.poll() is None
        finally:
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            tree.kill_all()  # whatever happens, nothing outlives the test
        out.seek(0)
        text = out.read().decode(errors="replace")
    if timed_out:
        pytest.fail(f"small_shm --mode {mode} did not finish within {TIMEOUT_S} s:\n"
                    f"{text[-4000:]}")
    records = {int(rank): json.loads(body) for rank, body in LINE.findall(text)}
    return proc.returncode, text, records


def test_memfd_segments_ignore_a_small_dev_shm():
    code, text, records = run_small_shm("memfd")
    assert code == 0, f"torchrun exited {code}:\n{text[-4000:]}"
    assert sorted(records) == list(range(NPROC)), f"missing rank reports:\n{text[-4000:]}"
    for rank, record in records.items():
        assert record["ok"], f"rank {rank}: {record['failures']}"
        assert record["checks"]["grad_max_rel_diff"] < 1e-5
        # Before the first backward one bucket (torch's): two 4096 x 4096 weights and their
        # biases, 128 MiB + 32 KiB of float32.
        assert record["checks"]["bucket_bytes"] == [2 * (4096 * 4096 + 4096) * 4]


def test_posix_segments_in_a_small_dev_shm_fail_with_the_remedy():
    code, text, records = run_small_shm("posix", {"DPTC_SHM": "posix"})
    # The ranks catch the error and exit 0: a worker killed by a signal (SIGBUS on a page
    # /dev/shm could not back) makes torchrun exit non-zero and report the signal.
    assert code == 0, f"torchrun exited {code}:\n{text[-4000:]}"
    assert "SIGBUS" not in text and "Signal 7" not in text, text[-4000:]
    assert sorted(records) == list(range(NPROC)), f"missing rank reports:\n{text[-4000:]}"
    for rank, record in records.items():
        assert not record["ok"], f"rank {rank} built a DDP with 64 MiB buckets in /dev/shm"
        assert record["error_type"] == "MemoryError" or "DistError" in record["error_mro"], \
            f"rank {rank}: {record['error_type']}: {record['error']}"
        assert "/dev/shm" in record["error"], record["error"]
        assert "shm-size" in record["error"], record["error"]
    # The rank whose reservation failed reports the MemoryError itself; the other hears of it.
    assert "MemoryError" in [record["error_type"] for record in records.values()]
