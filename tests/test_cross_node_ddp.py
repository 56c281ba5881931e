"""DDP over two simulated nodes of two ranks (run_ranks(nnodes=2), as tests/test_cross_node.py):
what a rank raises when a member on the other node fails.  Rank-side functions are in
tests/workers_cross_node_ddp.py.
"""

from tests._launch import run_ranks
from tests.test_cross_node import NNODES, PROPAGATION_S, WORLD, _describe

TARGET = "tests.workers_cross_node_ddp:"


def test_ddp_peer_on_the_other_node_aborts_raises_peer_lost():
    """Rank 3 (node 1) aborts while ranks 0-2 are in a DDP backward.  Ranks 0 and 1 (node 0)
    learn it in the cross-node step of a bucket, on the engine's thread; they raise
    PeerLostError naming the abort, as a collective would, not a bare DistError whose message
    wraps the bridge's ("the cross-node step (gloo) failed: PeerLostError: ..."), within
    PROPAGATION_S."""
    records = run_ranks(TARGET + "ddp_step_with_an_aborted_peer", WORLD, nnodes=NNODES,
                        timeout=90, args={"victim": 3})
    info = _describe(records)
    assert records[3]["error_type"] is None, info
    aborted_at = records[3]["after"]
    for rank in (0, 1, 2):
        record = records[rank]
        assert record["error_type"] == "PeerLostError", info
        assert "test abort on node 1" in record["error"], info
        assert "the cross-node step (gloo) failed" not in record["error"], info
        assert record["after"] - aborted_at < PROPAGATION_S, info


def test_uncaught_exception_on_the_other_node_is_named_everywhere():
    """Rank 3 (node 1) dies of an uncaught RuntimeError while ranks 0-2 wait in an all_reduce;
    its process is gone right after the traceback.  Rank 1, whose cross-node peer it is, sees
    gloo's connection close at once; every survivor must still raise PeerLostError naming
    rank 3's exception (dptc's excepthook writes the abort to the store before the process
    can exit), not only gloo's "Connection closed by peer"."""
    results = run_ranks(TARGET + "uncaught_then_exit", WORLD, nnodes=NNODES, timeout=90,
                        args={"victim": 3}, expect_failure=True)
    records = [result["value"] for result in results]
    info = _describe(records)
    assert results[3]["exitcode"] == 1, info
    for rank in (0, 1, 2):
        record = records[rank]
        assert record["error_type"] == "PeerLostError", info
        assert "rank 3 stopped with an uncaught RuntimeError: victim raised" in record["error"], \
            info


def test_sigkill_on_the_other_node_is_named_by_its_cross_node_peer():
    """Rank 3 (node 1) is SIGKILLed while ranks 0-2 wait in an all_reduce.  Rank 1, its
    cross-node peer, sees gloo's connection reset at once, before rank 2, on rank 3's node,
    has noticed the death; rank 1 must still raise PeerLostError naming rank 3's exit (rank 2
    writes it to the store within ABORT_POLL_S), not only gloo's connection error."""
    results = run_ranks("tests.workers_cross_node:killed_while_blocked", WORLD, nnodes=NNODES,
                        timeout=90, args={"victim": 3}, expect_failure=True)
    records = [result["value"] for result in results]
    info = _describe([r or {"error_type": None, "error": None, "after": 0.0} for r in records])
    assert results[3]["exitcode"] == -9, info
    for rank in (0, 1, 2):
        assert records[rank]["error_type"] == "PeerLostError", info
        assert "global rank 3 (pid " in records[rank]["error"], info
        assert "exited while global rank 2, on its node, waited for it" in \
            records[rank]["error"], info


def test_sigkill_named_in_a_pair_that_has_nobody_left_on_the_dead_node():
    """Rank 3 is SIGKILLed while rank 1 waits on it in the group [1, 3] (an HSDP replicate
    group): nobody of that group is left on node 1 to write its abort key, but rank 2 writes
    the world's when it notices the exit.  Rank 1 names rank 3's exit from there, not only
    gloo's connection error."""
    results = run_ranks(TARGET + "killed_in_a_cross_node_pair", WORLD, nnodes=NNODES,
                        timeout=90, expect_failure=True)
    records = [result["value"] for result in results]
    info = _describe([r or {"error_type": None, "error": None, "after": 0.0} for r in records])
    assert results[3]["exitcode"] == -9, info
    # Rank 0 waits on rank 1 in its node's segment, where no cross-node abort reaches it; it
    # raises once rank 1 aborts or exits (here, after rank 1's _observe lingers).
    for rank in (1, 2):
        assert records[rank]["error_type"] == "PeerLostError", info
        assert "exited while global rank 2, on its node, waited for it" in \
            records[rank]["error"], info
