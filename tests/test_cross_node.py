"""Groups that span nodes: failure propagation through the bridge, many rounds, and what the
reduce-scatter sends between nodes.

Two nodes of two ranks are simulated on this host (run_ranks(nnodes=2): GROUP_RANK differs, so
dptc builds one shared segment per node and a gloo bridge between them); DPTC_TIMEOUT is 30 s,
so a failure that is noticed only by a timeout fails the PROPAGATION_S bounds below.
Rank-side functions are in tests/workers_cross_node.py.
"""

import json
import tempfile
from pathlib import Path

import pytest

from tests._launch import run_ranks, run_torchrun_nodes

WORLD = 4
NNODES = 2
# A failure must reach every rank of both nodes within this many seconds (DPTC_TIMEOUT is 30).
PROPAGATION_S = 5.0
ACT_AFTER_S = 1.0  # tests/workers_cross_node.py: when rank 0 aborts / the victim dies
MANY_ROUNDS_COUNT = 200_003
MIN_SLOT_BYTES = 65536
DEFAULT_SLOT_BYTES = 1 << 20   # dptc/group.py DEFAULT_SLOT_BYTES
CACHE_LINE = 64                # csrc/shm.c, parts of a slot are multiples of 64 bytes
TARGET = "tests.workers_cross_node:"
FAILURE_SCRIPT = Path("tests") / "scripts" / "two_node_failure.py"
FAILURE_VICTIM = 3             # tests/scripts/two_node_failure.py VICTIM: local rank 1 of node 1


def _describe(records):
    return "\n".join(f"rank {r}: {rec['error_type']}: {rec['error']} after {rec['after']:.3f} s"
                      if rec else f"rank {r}: no record" for r, rec in enumerate(records))


def test_abort_reaches_the_other_node_without_waiting_for_gloo():
    """Rank 0 aborts while ranks 1-3 wait in an all_reduce it never joins.  Rank 1 hears it
    through the node's segment; ranks 2 and 3, waiting in gloo on the other node, through the
    store's abort key (polled every 0.1 s), not gloo's 30 s timeout."""
    records = run_ranks(TARGET + "abort_while_blocked", WORLD, nnodes=NNODES, timeout=60)
    info = _describe(records)
    assert records[0]["error_type"] is None, info
    aborted_at = records[0]["after"]
    assert aborted_at >= ACT_AFTER_S, info
    for rank in (1, 2, 3):
        record = records[rank]
        assert record["error_type"] == "PeerLostError", info
        assert "test abort" in record["error"], info
        assert record["after"] - aborted_at < PROPAGATION_S, info


@pytest.fixture(scope="module")
def killed():
    """One run for both SIGKILL tests: rank 1 kills itself ACT_AFTER_S after the barrier.
    Returns (records of every rank, None for rank 1; a description for messages)."""
    results = run_ranks(TARGET + "killed_while_blocked", WORLD, nnodes=NNODES, timeout=60,
                        args={"victim": 1}, expect_failure=True)
    records = [result["value"] for result in results]
    info = _describe(records) + "\n" + "\n".join(
        f"rank {r}: exit {result['exitcode']}, raised {result['error_type']}: {result['error']}"
        for r, result in enumerate(results))
    assert results[1]["exitcode"] == -9, info
    for rank in (0, 2, 3):
        assert results[rank]["exitcode"] == 0, info
        assert records[rank]["error_type"] is not None, info
        # Seconds from the kill to this rank's raise.
        assert records[rank]["after"] - ACT_AFTER_S < PROPAGATION_S, info
    return records, info


def test_sigkill_of_a_rank_fails_the_survivors_within_seconds(killed):
    """Rank 1 dies by SIGKILL while ranks 0, 2 and 3 wait in a collective: each raises within
    PROPAGATION_S; rank 0 (its node) and rank 2 (waiting in gloo on rank 0) with a DistError."""
    records, info = killed
    for rank in (0, 2):
        assert "DistError" in records[rank]["error_mro"], info


def test_sigkill_of_a_rank_fails_its_cross_node_peer_with_a_dist_error(killed):
    """Rank 3 waits in gloo on rank 1 (the same local index on the other node) when rank 1
    dies: it must raise a dptc.DistError like every survivor."""
    records, info = killed
    assert "DistError" in records[3]["error_mro"], info


def test_exception_in_the_bridge_keeps_its_type():
    """Rank 2's cross-node step raises ValueError: rank 2 raises that very ValueError, the
    others PeerLostError naming it, within PROPAGATION_S."""
    records = run_ranks(TARGET + "failing_bridge", WORLD, nnodes=NNODES, timeout=60,
                        args={"victim": 2})
    info = _describe(records)
    assert records[2]["error_type"] == "ValueError", info
    assert records[2]["error"] == "injected bridge failure", info
    for rank in (0, 1, 3):
        record = records[rank]
        assert record["error_type"] == "PeerLostError", info
        assert "injected bridge failure" in record["error"], info
        assert record["after"] < PROPAGATION_S, info


@pytest.mark.parametrize("nnodes", [2, 1])
def test_many_rounds_with_the_smallest_slots(nnodes):
    results = run_ranks(TARGET + "many_rounds", WORLD, nnodes=nnodes, timeout=90,
                        args={"count": MANY_ROUNDS_COUNT},
                        env={"DPTC_SLOT_BYTES": MIN_SLOT_BYTES})
    for rank, result in enumerate(results):
        assert result["nnodes"] == nnodes
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
        assert result["float_rs_avg_rel_diff"] < 1e-6
        # destroy_process_group joins the cross-node abort watcher (dptc/group.py _Watcher).
        assert result["watchers_after_destroy"] == [], f"rank {rank}: {result}"


def _elements_per(nbytes, elsize):
    """csrc/shm.c elements_per: what fits, a multiple of 64 bytes."""
    n = nbytes // elsize
    align = max(CACHE_LINE // elsize, 1)
    return n // align * align if n >= align else n


def test_reduce_scatter_sends_each_node_only_its_part():
    numel = (1 << 20) // 4   # a 1 MiB float32 input per rank
    results = run_ranks(TARGET + "reduce_scatter_traffic", WORLD, nnodes=NNODES, timeout=60,
                        args={"numel": numel})
    count = numel // WORLD                  # output elements per rank
    out_bytes = count * 4
    local_size = WORLD // NNODES
    # csrc/shm.c reduce_scatter: a slot holds the world's windows, a scratch window per node
    # and a received window per node; one all-to-all per round of window_max elements.
    window_max = _elements_per(DEFAULT_SLOT_BYTES // (WORLD + 2 * NNODES), 4)
    rounds = -(-count // window_max)
    for rank, result in enumerate(results):
        assert result["exact"], f"rank {rank}: wrong results"
        assert (result["nnodes"], result["local_size"]) == (NNODES, local_size)
        calls, sent, received = result["reduce_scatter"]["alltoall"]
        # Each all-to-all carries one window per node: in all, my output's size per node, of
        # which (nnodes - 1) / nnodes leaves the node: half the output bytes, not the 1 MiB
        # input nor an all-reduce's full tensor.
        assert (calls, sent, received) == (rounds, out_bytes * NNODES, out_bytes * NNODES), \
            f"rank {rank}: {result}"
        assert result["reduce_scatter"]["allreduce"] == [0, 0], f"rank {rank}: {result}"
        # The counters do see the all-reduce's bridge: an all_reduce of the same 1 MiB calls
        # gloo's allreduce on this rank's part (1/local_size) of it, and no all-to-all.
        assert result["all_reduce"]["alltoall"] == [0, 0, 0], f"rank {rank}: {result}"
        assert result["all_reduce"]["allreduce"][1] == numel * 4 // local_size, \
            f"rank {rank}: {result}"


def test_groups_with_unequal_members_per_node():
    """[0, 1, 2] and [1, 2, 3] on two nodes of two: each node holds a different number of
    members, so dptc lays the group out one member per node (every byte through gloo) and every
    collective must still be exact."""
    results = run_ranks(TARGET + "uneven_groups", WORLD, nnodes=NNODES, timeout=90)
    for rank, result in enumerate(results):
        assert not result["failures"], (rank, result["failures"])
        for members, (group_rank, size, node, nnodes, local_size) in result["layouts"].items():
            assert size == 3 and nnodes == 3 and local_size == 1 and node == group_rank, \
                (rank, members, result["layouts"])
    assert sorted(len(r["layouts"]) for r in results) == [1, 1, 2, 2], results


def test_local_rank_that_disagrees_with_the_hosts_fails_every_rank():
    """Launch variables set by hand as for two hosts (LOCAL_RANK 0, 1, 0, 1, no GROUP_RANK)
    on processes that share one host name: dptc tells nodes apart by host name and derives
    local ranks 0-3, which ranks 2 and 3 contradict.  Every rank, not only those two, raises
    the same ValueError at once, naming the ranks, the variables and the remedy; before, ranks
    0 and 1 waited DPTC_TIMEOUT (30 s) for the others and raised DistStoreError."""
    results = run_ranks(TARGET + "init_with_hand_set_layout", WORLD, nnodes=NNODES, timeout=90,
                        env={"GROUP_RANK": None, "GROUP_WORLD_SIZE": None})
    messages = {result["error"] for result in results}
    assert [result["error_type"] for result in results] == ["ValueError"] * WORLD, results
    assert len(messages) == 1, results
    message = messages.pop()
    for part in ("LOCAL_RANK", "rank 2 has LOCAL_RANK=0", "rank 3 has LOCAL_RANK=1",
                 "GROUP_RANK", "host name", "torchrun"):
        assert part in message, message
    assert max(result["after"] for result in results) < PROPAGATION_S, results


@pytest.mark.parametrize("how", ["uncaught", "exit", "sigkill"])
def test_torchrun_node_fails_on_a_peer_failure(how):
    """Two torchrun --nnodes=2 invocations of 2 ranks train HSDP (replicate across the nodes,
    shard within); global rank 3 (node 1) fails mid-step (tests/scripts/two_node_failure.py):
    an uncaught exception, an exception the script catches before sys.exit(1) while its
    interpreter takes 20 s to finish, or SIGKILL.  Both ranks of node 0 raise a dptc.DistError
    within PROPAGATION_S of the failure (not at DPTC_TIMEOUT, 30 s, nor once the victim's
    process is gone), and both torchrun invocations exit with an error.  Rank 2, the victim's
    node peer, raises a DistError as promptly unless its torchrun agent stops it first (torchrun
    stops a node's workers once another node's have failed)."""
    with tempfile.TemporaryDirectory(prefix="dptc-two-node-failure-") as out:
        outputs = run_torchrun_nodes([str(FAILURE_SCRIPT), "--how", how, "--out", out],
                                     nnodes=NNODES, nproc_per_node=WORLD // NNODES, timeout=150)
        records = {}
        for path in Path(out).glob("rank*.json"):
            record = json.loads(path.read_text())
            records[record["rank"]] = record
    report = "\n".join(f"--- node {node}: return code {code}\nstderr:\n{err[-2500:]}"
                       for node, (code, _, err) in enumerate(outputs)) + f"\nrecords: {records}"
    assert [code for code, _, _ in outputs] == [1, 1], report
    failed_at = records[FAILURE_VICTIM]["failed_at"]
    for rank in (0, 1, 2):
        if rank == 2 and rank not in records:
            continue
        record = records.get(rank, {})
        assert "DistError" in record.get("error_mro", ()), (rank, report)
        assert record["raised_at"] - failed_at < PROPAGATION_S, (rank, report)
    if how == "exit" and 2 in records:
        assert records[2]["error"].startswith(
            f"global rank {FAILURE_VICTIM} (pid "), report
        assert "closed the group" in records[2]["error"], report
