"""Process groups: initialisation paths, re-initialisation, deadlines, error types."""

import os
import subprocess
import sys

import pytest

from tests._launch import REPO_ROOT, run_ranks


def test_error_types_form_a_hierarchy():
    import dptc
    assert issubclass(dptc.DistError, RuntimeError)
    assert issubclass(dptc.DistTimeoutError, dptc.DistError)
    assert issubclass(dptc.DistTimeoutError, TimeoutError)
    assert issubclass(dptc.PeerLostError, dptc.DistError)
    assert issubclass(dptc.CollectiveMismatchError, dptc.DistError)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_timeout_is_refused(value, monkeypatch):
    from dptc import group
    monkeypatch.setenv("DPTC_TIMEOUT", value)
    with pytest.raises(ValueError, match="DPTC_TIMEOUT|timeout"):
        group._timeout_seconds(None)


def test_stuck_peer_raises_timeout_within_deadline():
    timeout = 3.0
    # Rank 1 stays alive 1 s past the window rank 0 must raise in, so it times out rather
    # than losing its peer.
    results = run_ranks("tests.workers_group:stuck_peer", 2, args={"stall": timeout + 3},
                        env={"DPTC_TIMEOUT": str(timeout)}, expect_failure=True, timeout=60)
    waiting = results[0]
    assert waiting["error_type"] == "DistTimeoutError", waiting
    assert timeout <= waiting["elapsed"] < timeout + 2.0, waiting["elapsed"]
    assert "global rank 1" in waiting["error"], waiting["error"]


@pytest.mark.parametrize("use_torch_init", [False, True])
def test_init_destroy_and_reinit(use_torch_init):
    results = run_ranks("tests.workers_group:reinit_and_info", 3,
                        args={"use_torch_init": use_torch_init}, timeout=90)
    for rank, r in enumerate(results):
        assert r["initialized_before"] is False
        assert (r["rank"], r["size"], r["initialized_after"]) == (rank, 3, True)
        assert r["layout"] == [0, 1, rank, 3]
        refused = ["ValueError", "Default process group has not been initialized", True]
        assert r["sums"] == [6.0, False, refused, "ValueError", 6.0, False], r["sums"]
        assert r["torch_initialized_at_end"] is True


def test_a_new_torch_group_after_destroy_starts_dptc_again():
    results = run_ranks("tests.workers_group:use_after_torch_reinit", 2, timeout=90)
    assert results == [[4.0, 4.0, 4.0]] * 2, results


@pytest.mark.parametrize("lag", [0.0, 1.0])
def test_reinit_after_torch_destroy(lag):
    """A script that sets up with dptc.init_process_group and cleans up with torch's
    destroy_process_group, in a loop (torch's DDP tutorial's setup/cleanup): each init makes
    a working group again, with torch.distributed up beside it (it used to return the stale
    group, torch.distributed left destroyed).  With rank 0 a second late to each cleanup,
    rank 1 used to connect to the store rank 0 still served and fail with "Broken pipe" (torch
    alone hangs there until its timeout): [Note: the last store] in dptc/group.py."""
    results = run_ranks("tests.workers_group:reinit_after_torch_destroy", 2,
                        args={"lag": lag}, timeout=90)
    for rank, sums in enumerate(results):
        assert sums == [[3.0, 1, True]] * 3, (rank, sums)


def test_a_store_server_lost_while_connecting_is_tried_again(monkeypatch):
    """A rank that comes round while rank 0 still serves the last initialisation's store can
    lose that server while it connects (rank 0 frees it): TCPStore raises DistNetworkError
    ("Failed to recv, got 0 bytes"), and the rank tries again until rank 0 serves the new
    store ([Note: the last store] in dptc/group.py).  In-process: the first TCPStore this rank
    makes fails as that one did, the second reaches a live server.

    Old behaviour: the DistNetworkError ended init_process_group (once in a fresh-clone CI run
    of test_reinit_after_torch_destroy[1.0])."""
    import datetime
    import torch.distributed as dist
    from dptc import group
    from tests._launch import free_port
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    real, calls = dist.TCPStore, []

    def flaky_store(*args, **kwargs):
        calls.append(kwargs.get("is_master"))
        if len(calls) == 1:
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely "
                                        "closed. Did the remote server shutdown or crash?")
        return real(*args, **kwargs)

    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(group.dist, "TCPStore", flaky_store)
    monkeypatch.setattr(group, "_torch_store", None)
    made = group._env_store(datetime.timedelta(seconds=10))
    assert calls == [False, False], calls
    assert (made["rank"], made["world_size"]) == (1, 2), made
    made["store"].set("from-rank-1", "yes")
    assert server.get("from-rank-1") == b"yes"


@pytest.mark.parametrize("how", ["destroy", "exit", "raise"])
def test_a_forked_child_leaving_leaves_the_group_alone(how):
    # Before [Note: forked children] (csrc/module.c), the child's destroy marked rank 0's
    # records left, so rank 1 raised PeerLostError ("global rank 0 ... closed the group") at the
    # second all_reduce; at exit the child also destroyed torch's gloo group, which aborted
    # (SIGABRT) or hung it, and an uncaught exception in it aborted the parent's group.
    results = run_ranks("tests.workers_group:forked_child_leaves", 2, args={"how": how},
                        timeout=90)
    assert results[0] == {"sums": [2.0, 3.0], "child": 0}, results
    assert results[1] == {"sums": [2.0, 3.0]}, results


def test_a_forked_child_dropping_a_pending_work_leaves_it_to_the_rank():
    # Before, the child waited for its copy of the work until its deadline (nothing completes
    # it there), then aborted the rank's group: the next all_reduce failed on both ranks.
    results = run_ranks("tests.workers_group:forked_child_drops_a_work", 2,
                        args={"late": 1.5}, env={"DPTC_TIMEOUT": "4"}, timeout=90)
    assert results[0] == {"sums": [3.0, 3.0], "child": 0, "pending_at_fork": True}, results
    assert results[1] == {"sums": [3.0, 3.0]}, results


@pytest.mark.parametrize("mesh", ["default", "hsdp", "fsdp1"])
@pytest.mark.parametrize("interpreter", ["forked", "fresh"])
def test_exit_frees_the_torch_groups_dptc_made(mesh, interpreter):
    """dptc's exit handler frees the gloo groups it set up, joining their threads while the
    interpreter still runs ([Note: torch groups at exit] in dptc/group.py).  Before, a
    DeviceMesh (fully_shard's own, or one the script holds) and FSDP1's `process_group`
    kept the world's group and its two gloo threads alive into the interpreter's
    finalisation, where a thread dropping a finished work's tensor aborted the process
    (SIGABRT) about once in a few thousand exits.
    In a fresh interpreter (not forked from the test zygote, which imported torch's FSDP
    before any group existed) torch.distributed.nn's functions, imported by torch's FSDP,
    also held the group in their default arguments when imported after initialisation."""
    env = {"DPTC_TEST_ZYGOTE": "0"} if interpreter == "fresh" else None
    results = run_ranks("tests.workers_group:torch_groups_at_exit", 2, args={"mesh": mesh},
                        env=env, timeout=120)
    for result in results:
        # Two threads per gloo group: the world's, and with "hsdp" the replicate dimension's.
        assert result["before"] == (4 if mesh == "hsdp" else 2), results
        assert result["after"] == 0, results
        assert result["worked"], results


def test_work_wait_accepts_timedelta():
    results = run_ranks("tests.workers_group:wait_with_timedelta", 2, timeout=60)
    assert results == [[True, True, 2.0]] * 2


def test_single_process_without_torchrun():
    code = ("import json, tests.workers_group as w; print('RESULT', json.dumps("
            "w.single_process()))")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    # Keep tools/sanitize.sh's runtimes, which must load first.
    env.update({k: v for k, v in os.environ.items()
                if k in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")})
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][0]
    size, reduced, gathered = __import__("json").loads(line.split(" ", 1)[1])
    assert size == 1
    assert reduced == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert gathered == reduced
