"""How dptc finds the nodes when the launch variables are set by hand instead of by torchrun.

dptc tells nodes apart by GROUP_RANK (torchrun's node index), else by host name, and checks
LOCAL_RANK against the layout it derives (dptc/group.py; a LOCAL_RANK that disagrees is tested in
tests/test_cross_node.py).  Four ranks on this host stand for two nodes of two.  Rank-side functions are in tests/workers_node_layout.py.
"""

import re

import pytest

from tests._launch import run_ranks

WORLD = 4
TARGET = "tests.workers_node_layout:"


def test_group_rank_set_by_hand_makes_two_nodes():
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GROUP_RANK (0, 0, 1, 1) alone, without
    LOCAL_RANK or LOCAL_WORLD_SIZE: two nodes of two, and the all_reduce is exact."""
    results = run_ranks(TARGET + "layout", WORLD, nnodes=2, timeout=90,
                        env={"LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None})
    assert [(r["node"], r["nnodes"], r["local_rank"], r["local_size"]) for r in results] == \
        [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)], results
    assert all(r["sum"] == 10.0 for r in results), results


@pytest.mark.parametrize("how", ["abort", "sigkill"])
def test_peer_lost_in_a_subgroup_names_the_global_rank(how):
    """Global rank 3 aborts, or is killed, while rank 2 waits on it in the group [2, 3] on node
    1.  Rank 2's PeerLostError names rank 3 by its global rank; the group's own layout (rank 3
    is local rank 1 of the group's only node, node 0) is not the launcher's, and used to read
    "local rank 1 of node 0" for a process on node 1."""
    results = run_ranks(TARGET + "subgroup_peer_lost", WORLD, nnodes=2, timeout=90,
                        args={"how": how}, expect_failure=True)
    got = results[2]["value"]
    assert results[2]["exitcode"] == 0 and got is not None, results[2]
    assert got["error_type"] == "PeerLostError", got
    if how == "abort":
        assert got["error"] == "global rank 3 aborted the group: test abort", got
    else:
        assert re.fullmatch(r"global rank 3 \(pid \d+\) exited while global rank 2, on its node, "
                            r"waited for it", got["error"]), got


def test_hybrid_shard_on_nodes_of_unequal_size_raises():
    """FSDP1 HYBRID_SHARD, no process_group, on nodes of two and one rank: there is no
    (replicate, shard) layout of whole nodes.  Every rank raises ValueError naming the nodes'
    sizes and the remedies, where dptc used to make every node a replica of one rank each
    (every rank held all 72 parameters: NO_SHARD, silently)."""
    results = run_ranks(TARGET + "hybrid_shard_on_uneven_nodes", 3, timeout=90)
    for rank, result in enumerate(results):
        assert result.get("error", "").startswith(
            "ShardingStrategy.HYBRID_SHARD without process_group shards within a node"), \
            (rank, result)
        assert "the nodes hold [2, 1] ranks" in result["error"], (rank, result)
        assert "process_group=(shard group, replicate group)" in result["error"], (rank, result)
