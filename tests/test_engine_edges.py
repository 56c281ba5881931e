"""The engine's edges: a wait that gives up, Ctrl-C, raw addresses, threads sharing a group.

Layer: one rank (raw addresses) and two ranks (the rest).  Rank-side code is in
tests/workers_edges.py; each worker catches what it expects and returns error types, messages
and monotonic timestamps, which the tests bound here.  dptc only: these are dptc's promises
(csrc/engine.h, [Note: interrupts] in csrc/dptc.h, [Note: memory of unfinished work] in
csrc/module.c), not torch's.
"""

import os
import re

import pytest

from tests._launch import once, run_ranks

# Seconds of scheduling noise a bound allows on a loaded 2-core machine.
SLACK_S = 1.0


# ---------------------------------------------------------------------------------------------
# A wait that gives up

WAIT_TIMEOUT_S = 0.5   # what the worker passes to wB.wait
LATE_S = 1.5           # rank 1 enters its collectives this late
GIVE_UP_DPTC_TIMEOUT = 20


_give_up_runs = {}


def _give_up_results(tmp_path_factory):
    """The results of the give-up run, run once and shared by the two tests below (a failed run
    is remembered too, so the second test reports it without running it again)."""
    def launch():
        flag_dir = tmp_path_factory.mktemp("give-up")
        return run_ranks("tests.workers_edges:wait_gives_up", 2,
                         args={"flag_dir": str(flag_dir), "late_s": LATE_S, "count": 100_000},
                         env={"DPTC_TIMEOUT": GIVE_UP_DPTC_TIMEOUT}, timeout=60)
    return once(_give_up_runs, "run", launch)


def test_wait_that_gives_up_leaves_no_work_behind(tmp_path_factory):
    """Rank 0 queues wA = all_reduce(A) and wB = all_reduce(B); rank 1 issues its two only
    1.5 s later.  wB.wait(timeout=0.5) gives up: DistTimeoutError within about 0.5 s, and it
    aborts the group before returning, so neither wA nor wB is still queued to write into A or
    B later: both are completed when wait returns, B keeps the sentinel rank 0 then writes
    into it, every later collective raises at once, and rank 1's collectives fail fast
    (long before DPTC_TIMEOUT, 20 s) naming rank 0's wait.

    Old behaviour: wait raised DistTimeoutError with wB still queued behind wA (is_completed()
    False) and the group healthy; when rank 1 arrived 1.5 s later both collectives completed,
    rank 1 got no error, and rank 0's B - already handed back to the caller - was overwritten
    with the sum.
    """
    r0, r1 = _give_up_results(tmp_path_factory)
    print(f"wait gave up after {r0['wait_elapsed']:.3f} s; rank 1 raised after "
          + ", ".join(f"{call['elapsed']:.4f} s" for call in r1["calls"]))
    # Rank 0: the wait times out on time, and both works are over when it returns.
    assert r0["wait_error"] is not None and r0["wait_error"]["type"] == "DistTimeoutError", r0
    assert WAIT_TIMEOUT_S <= r0["wait_elapsed"] < WAIT_TIMEOUT_S + 0.5 + SLACK_S, r0
    assert r0["completed"] == {"A": True, "B": True}, r0
    # Nothing wrote into B after the wait returned, although rank 1 came and went meanwhile.
    assert r0["B_checked_at"] >= LATE_S + 1.0, r0
    assert r0["B_wrong"] == 0, r0
    # The group stays failed: a later collective raises at once, with the recorded failure.
    assert r0["later_error"] is not None and "DistError" in r0["later_error"]["mro"], r0
    assert r0["later_error"]["type"] == "DistTimeoutError", r0
    assert r0["later_elapsed"] < 0.5, r0
    # Rank 1: both collectives fail fast, instead of completing (or timing out after
    # DPTC_TIMEOUT), and say that rank 0 gave up.
    assert len(r1["calls"]) == 2, r1
    for call in r1["calls"]:
        assert call["error"] is not None and "DistError" in call["error"]["mro"], r1
        assert re.search(r"\brank 0\b", call["error"]["message"]), r1
        assert call["elapsed"] < SLACK_S, r1
    assert r1["B"] == [20.0] * 4, r1  # rank 1's B untouched too


def test_peer_of_a_wait_that_gave_up_raises_peer_lost(tmp_path_factory):
    """Rank 1 never waited past a timeout: rank 0 aborted the group (its Work.wait gave up), so
    rank 1's collectives raise PeerLostError ("a peer exited or aborted"), not
    DistTimeoutError ("a wait passed the group's timeout").

    Old behaviour: rank 1's collectives completed (nothing was aborted)."""
    _, r1 = _give_up_results(tmp_path_factory)
    assert [call["error"] and call["error"]["type"] for call in r1["calls"]] == \
        ["PeerLostError"] * 2, r1


# ---------------------------------------------------------------------------------------------
# Ctrl-C

SIGNAL_AFTER_S = 1.0
INTERRUPT_LATENCY_S = 1.5     # signal to KeyboardInterrupt on rank 0
PROPAGATION_S = 3.0           # signal to PeerLostError on rank 1
INTERRUPT_DPTC_TIMEOUT = 30


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_ctrl_c_interrupts_a_stuck_collective(mode):
    """SIGINT to rank 0 while it waits in a collective that cannot complete (rank 1 waits on
    another stream) raises KeyboardInterrupt on rank 0 within INTERRUPT_LATENCY_S and aborts the
    group, so rank 1 raises PeerLostError naming the interruption within PROPAGATION_S of the
    signal - long before DPTC_TIMEOUT (30 s).

    mode="blocking" waits on the calling thread (Group.run), mode="async" in Work.wait().
    Old behaviour: no wait loop ran Python's signal handlers, so Ctrl-C was held until
    DPTC_TIMEOUT expired (both ranks raised DistTimeoutError after 30 s); nor were there streams
    (`stream=` raised TypeError).
    """
    results = run_ranks("tests.workers_edges:interrupted", 2,
                        args={"mode": mode, "signal_after_s": SIGNAL_AFTER_S},
                        env={"DPTC_TIMEOUT": INTERRUPT_DPTC_TIMEOUT}, timeout=60)
    r0, r1 = results
    assert r0["signal_at"] is not None, r0
    assert r0["error"] is not None and r0["error"]["type"] == "KeyboardInterrupt", r0
    assert r1["error"] is not None and r1["error"]["type"] == "PeerLostError", r1
    assert re.search(r"(?i)interrupt", r1["error"]["message"]), r1
    latency = r0["raised_at"] - r0["signal_at"]
    propagation = r1["raised_at"] - r0["signal_at"]
    print(f"{mode}: KeyboardInterrupt {latency:.3f} s after SIGINT; "
          f"PeerLostError on rank 1 {propagation:.3f} s after SIGINT")
    assert 0 <= latency < INTERRUPT_LATENCY_S, (latency, r0)
    assert 0 <= propagation < PROPAGATION_S, (propagation, r1)


# ---------------------------------------------------------------------------------------------
# A segment another dptc build made

def test_a_segment_of_another_layout_version_is_refused_naming_both():
    """A local rank that opens a segment whose layout version is not its build's (ranks of one
    node running different dptc builds; SHM_VERSION changes with the segment's layout, as it
    did for [Note: a rank that leaves] and [Note: several pieces] in csrc/shm.c) raises
    DistError naming both versions; a segment of another shape
    names what it has and what this rank expects.

    Old behaviour: both said "was not created for this group" with the segment's local ranks,
    streams and slot bytes, which matched this rank's in the first case."""
    import mmap
    import struct
    import dptc
    from dptc import _C
    creator = _C.Group(0, 2, 0, 2, 0, 1, "/dptc-test-version", True, 65536, 5.0, 1)
    try:
        path = creator.segment_path()
        fd = os.open(path, os.O_RDWR)
        try:
            header = mmap.mmap(fd, 4096)
        finally:
            os.close(fd)
        # The build's own version (SHM_VERSION), as its creator wrote it; an older build's is
        # one less.
        magic, version = struct.unpack_from("<II", header, 0)
        assert magic == 0x64707463 and version >= 2, (hex(magic), version)
        struct.pack_into("<I", header, 4, version - 1)
        with pytest.raises(dptc.DistError) as raised:
            _C.Group(1, 2, 1, 2, 0, 1, path, False, 65536, 5.0, 1)
        assert str(raised.value) == (
            f"shared segment {path} has magic 64707463 version {version - 1}, and this dptc "
            f"build reads magic 64707463 version {version}: every rank of a node must run the "
            f"same dptc build")
        struct.pack_into("<II", header, 4, version, 3)    # this version, 3 local ranks
        with pytest.raises(dptc.DistError) as raised:
            _C.Group(1, 2, 1, 2, 0, 1, path, False, 65536, 5.0, 1)
        assert str(raised.value) == (
            f"shared segment {path} was not created for this group (3 local ranks, 1 streams, "
            f"65536 slot bytes; this rank expects 2, 1, 65536)")
        struct.pack_into("<I", header, 8, 2)
        header.close()
        opened = _C.Group(1, 2, 1, 2, 0, 1, path, False, 65536, 5.0, 1)
        opened.close()
    finally:
        creator.close()


# ---------------------------------------------------------------------------------------------
# Raw addresses

def test_run_refuses_raw_addresses():
    """Group.run takes tensors and asks each for its data pointer; an int in a tensor's place
    is a TypeError that mentions addresses, and the group stays usable.

    Old behaviour: an int was taken as a data pointer (PyLong_AsVoidPtr), so the engine read and
    wrote memory at address 12345: the rank died of SIGSEGV."""
    (outcomes,) = run_ranks("tests.workers_edges:raw_addresses", 1, timeout=60)
    for case in ("both", "output"):
        error = outcomes[case]
        assert error is not None and error["type"] == "TypeError", (case, outcomes)
        assert "address" in error["message"], (case, outcomes)
    assert outcomes["after"] == [2.5] * 3, outcomes


def test_all_reduce_of_a_list_of_tensors():
    """An all-reduce whose output is a list of tensors (input None) reduces each in place,
    as one operand of their summed size, exactly (float64 integers, 2 ranks, SUM and AVG); an
    input given with it, or a count other than the pieces' total, is a ValueError that says
    so, raised before anything runs."""
    world = 2
    results = run_ranks("tests.workers_edges:all_reduce_pieces", world, timeout=60)
    sizes = (5, 70001, 3)
    ranks_sum = sum(r + 1 for r in range(world))
    for result in results:
        for k, n in enumerate(sizes):
            expected = [float(i * ranks_sum + world * k) for i in range(n)]
            assert result["sum"][k] == expected, k
            assert result["avg"][k] == [v / world for v in expected], k
        assert result["errors"]["input"]["type"] == "ValueError", result["errors"]
        assert "input=None" in result["errors"]["input"]["message"], result["errors"]
        assert result["errors"]["count"]["type"] == "ValueError", result["errors"]
        assert "add up to" in result["errors"]["count"]["message"], result["errors"]


# ---------------------------------------------------------------------------------------------
# Several Python threads on one group

THREAD_ITERATIONS = 50


def test_threads_on_their_own_streams():
    """Two Python threads per rank, thread k issuing 50 blocking all_reduces on stream k:
    every element of every result equals the math exactly (float64 integers).

    Old behaviour (before the streams rework): a group had one stream and collectives took no
    `stream=`, so this raised TypeError; two threads had to share one queue."""
    failures = run_ranks("tests.workers_edges:threads_own_streams", 2,
                         args={"iterations": THREAD_ITERATIONS, "count": 1000}, timeout=90)
    for rank, rank_failures in enumerate(failures):
        assert rank_failures == [], f"rank {rank}:\n" + "\n".join(rank_failures[:20])


def test_threads_sharing_a_stream_are_serialised():
    """Two Python threads per rank issue identical all_reduces on stream 0, thread t of rank r
    contributing (r + 1) * (t + 1).

    The contract: collectives that several threads issue on one stream are serialised in
    arrival order (each gets the stream's next sequence number); none fails, none hangs, none
    is torn.  Which thread of rank 0 pairs with which thread of rank 1 is the caller's business,
    as it is with torch.distributed: the engine does not order threads across ranks.  So each
    result is one of the valid sums (r0 contribution 1 or 2) + (r1 contribution 2 or 4), it
    contains the issuing thread's own contribution, and collective #i gives the same sum on
    both ranks, so the two ranks see the same multiset of sums.

    Old behaviour: the one-stream engine serialised this case too (its `busy` flag), so this
    test passes on it; it guards the contract through the per-stream rework, where each stream
    has its own lock, queue and executor.
    """
    results = run_ranks("tests.workers_edges:threads_one_stream", 2,
                        args={"iterations": THREAD_ITERATIONS, "count": 1000}, timeout=90)
    contribution = {(r, t): (r + 1) * (t + 1) for r in range(2) for t in range(2)}
    for rank, result in enumerate(results):
        assert result["errors"] == [], (rank, result["errors"])
        for t, sums in enumerate(result["sums"]):
            assert len(sums) == THREAD_ITERATIONS, (rank, t, sums)
            mine = contribution[(rank, t)]
            valid = {mine + contribution[(1 - rank, u)] for u in range(2)}
            bad = [s for s in sums if s not in valid]
            assert not bad, f"rank {rank} thread {t}: results {bad} not in {sorted(valid)}"
    multisets = [sorted(s for sums in result["sums"] for s in sums) for result in results]
    assert multisets[0] == multisets[1]
    # Every contribution of every thread went into exactly one collective.
    everything = multisets[0]
    assert len(everything) == 2 * THREAD_ITERATIONS
    for r in range(2):
        for t in range(2):
            used = sum(1 for s in everything
                       if any(s == contribution[(r, t)] + contribution[(1 - r, u)]
                              for u in range(2)))
            assert used == THREAD_ITERATIONS, (r, t, everything)


# ---------------------------------------------------------------------------------------------
# A Work dropped without wait()

DROP_LATE_S = 1.5


@pytest.mark.parametrize("outcome", ["completes", "gives_up"])
def test_dropped_work_keeps_its_tensor_until_the_collective_is_over(outcome):
    """Rank 0 drops the only reference to an all_reduce's tensor and then its Work, without
    wait(), while rank 1 arrives 1.5 s later.  The Work holds the tensor until the collective
    is over: dropping it returns only then, the tensor alive at every 10 ms sample until it
    does (but the last 50 ms), freed right after.  With DPTC_TIMEOUT 20 s the collective
    completes (rank 1 gets the sum); with 0.5 s it fails at its deadline, aborting the group,
    so rank 1 raises PeerLostError and nothing writes into freed memory.

    Old behaviour: dropping the Work released the tensor at once, while the queued collective
    still held its address and wrote the sum into it 1.5 s later."""
    timeout = 20 if outcome == "completes" else 0.5
    r0, r1 = run_ranks("tests.workers_edges:dropped_work", 2,
                       args={"late_s": DROP_LATE_S, "count": 1 << 20},
                       env={"DPTC_TIMEOUT": timeout}, timeout=60)
    assert r0["samples_during"] >= 10 and r0["alive_during"], r0
    assert not r0["alive_after"], r0
    if outcome == "completes":
        assert DROP_LATE_S - 0.2 <= r0["drop_elapsed"] < DROP_LATE_S + SLACK_S, r0
        assert r1["error"] is None and r1["values"] == [3.0], r1
    else:
        # The collective's own deadline (DPTC_TIMEOUT from its submission) ends it.
        assert timeout - 0.2 <= r0["drop_elapsed"] < timeout + SLACK_S, r0
        assert r1["error"] is not None and r1["error"]["type"] == "PeerLostError", r1
        assert r1["elapsed"] < SLACK_S, r1


# ---------------------------------------------------------------------------------------------
# The reducer's step end

def test_interrupted_backward_keeps_in_place_gradients_until_the_step_ends():
    """Rank 0's backward raises after the second layer's bucket was launched, all-reducing
    that layer's .grad in place, while rank 1 is 1.5 s late.  Rank 0 drops its .grad; the
    reducer still holds it.  Rank 0's next forward raises at once (the step was interrupted),
    aborting the group before the reducer lets the gradient go; memory rank 0 fills afterwards
    stays untouched when rank 1 comes, and rank 1 raises PeerLostError at once.

    Old behaviour: the step's end released the gradients with the all-reduce still queued, and
    rank 1's arrival completed it, writing the average into freed memory."""
    r0, r1 = run_ranks("tests.workers_edges:interrupted_step_end", 2,
                       args={"late_s": DROP_LATE_S}, timeout=60)
    assert r0["buckets"] == r1["buckets"] == 2, (r0, r1)
    assert r0["backward_error"]["type"] == "ValueError", r0
    assert r0["held_by_reducer"], r0
    assert r0["forward_error"]["type"] == "RuntimeError", r0
    assert "interrupted" in r0["forward_error"]["message"], r0
    assert r0["forward_s"] < SLACK_S, r0
    assert r0["released_after"], r0
    assert r0["junk_intact"], r0
    assert r1["error"] is not None and r1["error"]["type"] == "PeerLostError", r1
    assert r1["elapsed"] < SLACK_S, r1
