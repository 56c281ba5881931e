"""Subgroups, torch groups and DeviceMesh groups, DDP on subgroups, and dptc's streams.

Layer: several ranks.  Rank-side code is in tests/workers_subgroups.py: each member computes the
expected result of every collective on its groups from the members' regenerated inputs, so the
torch run (gloo, the reference) checks the test logic and the dptc run checks dptc.

Groups, made by all 4 ranks in this order: [0, 1], [2, 3], [0, 2], [1, 3], [3, 0] (given
unsorted; torch sorts group ranks).  On 2 simulated nodes of 2 ranks, [0, 1] and [2, 3] are
per-node groups, [0, 2] and [1, 3] one rank per node, [0, 3] spans both nodes.

One launch per implementation runs every group check and the DDP check (one more, dptc only,
for two simulated nodes); the tests below share it and report its sections.  Streams and the
collective mismatch (dptc only) have a launch each; the torchrun test two torchrun runs.
"""

import re
from pathlib import Path

import pytest

from tests._launch import once, run_ranks, run_torchrun_nodes
from tests._compare import max_rel

SEED = 11
LAUNCH_TIMEOUT_S = 120
TWO_NODE_SCRIPT = Path("tests") / "scripts" / "two_node_subgroups.py"
# dptc raises from a wait longer than this; a hang (e.g. groups that block each other) then
# costs this much, not the launch timeout.
DPTC_TIMEOUT_S = 30

# Per impl: the sources of groups (torch's own groups are torch.distributed.new_group groups)
# and the kinds of group DDP gets.
SOURCES = {"torch": ("own", "mesh"), "dptc": ("own", "torch", "mesh")}
DDP_KINDS = {"torch": ("own",), "dptc": ("own", "torch")}

# (impl, nnodes) -> results of one launch, or the AssertionError it raised.
_runs = {}


def _launch(impl, nnodes=1):
    """One node: every group check and the DDP check (workers_subgroups.all_checks), one launch.
    Two simulated nodes: the group checks on the own groups, with the node layout."""
    if nnodes == 1:
        target = "tests.workers_subgroups:all_checks"
        args = {"impl": impl, "sources": list(SOURCES[impl]),
                "ddp_kinds": list(DDP_KINDS[impl]), "seed": SEED}
    else:
        target = "tests.workers_subgroups:subgroup_checks"
        args = {"impl": impl, "sources": ["own"], "seed": SEED, "layout": True}
    return once(_runs, (impl, nnodes),
                lambda: run_ranks(target, 4, nnodes=nnodes, args=args,
                                  env={"DPTC_TIMEOUT": str(DPTC_TIMEOUT_S)},
                                  timeout=LAUNCH_TIMEOUT_S))


def _group_results(impl, nnodes=1):
    results = _launch(impl, nnodes)
    return [result["groups"] for result in results] if nnodes == 1 else results


def _assert_clean(results, source, section):
    failures = [f"rank {rank}: {line}" for rank, result in enumerate(results)
                for line in result[source][section]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# 1. The implementation's own new_group, one node

@pytest.mark.parametrize("section", ["members", "nonmembers", "concurrent"])
def test_own_groups(impl, section):
    """members: get_rank/get_world_size (and .rank/.size/.ranks for dptc), all_reduce (SUM,
    AVG; float32, bfloat16, int64; n = 0, 1, 1023, 300001), broadcast from every member by
    global src and by group_src, all_gather_into_tensor, reduce_scatter_tensor(SUM) with
    distinct blocks, barrier(group) holding until the last member arrives.
    nonmembers: NON_GROUP_MEMBER, get_rank/get_world_size -1, every collective returns None
    and leaves its tensors alone.
    concurrent: each rank has async work on two groups in flight at once (issued in a global
    order), every result is its own group's."""
    _assert_clean(_group_results(impl), "own", section)


def test_own_groups_cyclic_issue_order(impl):
    """Two groups in flight per rank, issued so that rank 0 waits on 1, 1 on 3, 3 on 2 and 2 on
    0 (CYCLIC_ORDER): completes only if a group's work does not wait behind another group's."""
    _assert_clean(_group_results(impl), "own", "cyclic")


# ---------------------------------------------------------------------------------------------
# 2. torch-made groups and DeviceMesh groups handed to the implementation

# For torch, "torch" groups are its own groups (test_own_groups): only the mesh is added.
@pytest.mark.parametrize("impl, source", [("dptc", "torch"), ("torch", "mesh"),
                                          ("dptc", "mesh")])
@pytest.mark.parametrize("section", ["members", "nonmembers", "concurrent", "cyclic"])
def test_torch_and_mesh_groups(impl, source, section):
    """The checks of test_own_groups on groups from torch.distributed.new_group, and on
    mesh.get_group("shard") / mesh.get_group("replicate") of a 2x2 DeviceMesh (no non-members
    there: every rank is in one group per dimension)."""
    _assert_clean(_group_results(impl), source, section)


# ---------------------------------------------------------------------------------------------
# 3. Two simulated nodes (dptc only: gloo has no notion of nodes, the torch run would repeat
#    test_own_groups)

@pytest.mark.parametrize("impl", ["dptc"])
@pytest.mark.parametrize("section", ["members", "nonmembers", "concurrent", "cyclic"])
def test_two_simulated_nodes(impl, section):
    """4 ranks as 2 nodes x 2: per-node groups, one-rank-per-node groups and [0, 3]; also
    group.nnodes (nodes the group spans) and group.local_size (members on this node)."""
    _assert_clean(_group_results(impl, nnodes=2), "own", section)


# ---------------------------------------------------------------------------------------------
# 4. Two real torchrun invocations

def test_two_torchrun_nodes(impl):
    """The checks of test_two_simulated_nodes (without the 300001-element cases) under two
    torchrun --nnodes=2 --nproc_per_node=2 invocations."""
    outputs = run_torchrun_nodes([str(TWO_NODE_SCRIPT), "--impl", impl], nnodes=2,
                                 nproc_per_node=2, timeout=180,
                                 env={"DPTC_TIMEOUT": str(DPTC_TIMEOUT_S)})
    text = "\n".join(out for _, out, _ in outputs)
    report = "\n".join(f"--- node {node}: return code {code}\nstdout:\n{out[-3000:]}\n"
                       f"stderr:\n{err[-3000:]}" for node, (code, out, err) in enumerate(outputs))
    assert all(code == 0 for code, _, _ in outputs), report
    # Ranks of one node share the stdout pipe, so their lines may interleave.
    ranks = sorted(int(r) for r in re.findall(r"TWO_NODE_SUBGROUPS_OK rank=(\d+)", text))
    assert ranks == [0, 1, 2, 3], report


# ---------------------------------------------------------------------------------------------
# 5. DDP on subgroups

DDP_TOLERANCE = 1e-5
REPLICA_AGREEMENT = 1e-6
# Two replicas trained on different data end up at least this far apart (relative), and
# training moves the parameters at least this far (measured: by 0.18 to 0.26).
REPLICAS_DIFFER = 1e-3


def test_ddp_on_subgroups(impl):
    """Replicas over [0, 1] and [2, 3] (process_group=), 3 SGD steps on per-rank batches: each
    rank's parameters equal single-process SGD on its two members' batches concatenated; the
    members of a replica agree; the two replicas differ.  dptc: with dptc.new_group and with
    torch.distributed.new_group groups; torch: its DDP with torch.distributed.new_group."""
    results = [result["ddp"] for result in _launch(impl)]
    problems = []
    for kind in DDP_KINDS[impl]:
        per_rank = [result[kind] for result in results]
        for rank, result in enumerate(per_rank):
            if not result["ref_rel"] <= DDP_TOLERANCE:
                problems.append(f"{kind}: rank {rank} (replica {result['replica']}) is "
                                f"{result['ref_rel']:.3g} (relative) from single-process "
                                f"training on its replica's batches; allowed {DDP_TOLERANCE}")
            if not result["moved"] > REPLICAS_DIFFER:
                problems.append(f"{kind}: rank {rank}: training moved the parameters by only "
                                f"{result['moved']:.3g} (test setup)")
        for a, b in ((0, 1), (2, 3)):
            rel = max_rel([per_rank[b]["params"]], [per_rank[a]["params"]])
            if not rel <= REPLICA_AGREEMENT:
                problems.append(f"{kind}: ranks {a} and {b} (one replica) differ by {rel:.3g}")
        rel = max_rel([per_rank[2]["params"]], [per_rank[0]["params"]])
        if not rel > REPLICAS_DIFFER:
            problems.append(f"{kind}: replicas [0, 1] and [2, 3] differ by only {rel:.3g}; "
                            f"they trained on different batches")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# 6, 7. Streams (dptc only: torch has no such keyword)

_streams = {}


def _stream_run():
    return once(_streams, "run",
                lambda: run_ranks("tests.workers_subgroups:stream_checks", 2,
                                  args={"impl": "dptc"}, env={"DPTC_TIMEOUT": "20"},
                                  timeout=90))


@pytest.mark.parametrize("section", ["attributes", "held", "concurrent", "bad_stream",
                                     "order"])
def test_streams(section):
    """attributes: new_group([0, 1]).num_streams == 2; all_reduce(stream=1) on it.
    held: rank 0 has a 256 MiB reduce_scatter_tensor on stream 1 that rank 1 submits only 0.5 s
    after its stream-0 op completed; rank 0's 1 KiB all_gather_into_tensor on stream 0 must
    complete meanwhile (a serialising implementation deadlocks and times out).
    concurrent: both ranks submit the big op, then the small one; the small one finishes
    (wait()) while the big one's is_completed() is still False, in less time.
    Both: the two results are exact.
    bad_stream: stream=5, -1, 2 raise ValueError naming `stream`; the group stays usable.
    order: A1, A2 on stream 0 and B1, B2 on stream 1, interleaved differently on the two
    ranks, all async, complete with correct results."""
    results = _stream_run()
    failures = [f"rank {rank}: {line}" for rank, result in enumerate(results)
                for line in result[section]]
    timings = [result["timings"] for result in results]
    assert not failures, "\n".join(failures) + f"\ntimings per rank: {timings}"


def test_stream_mismatch_raises_everywhere():
    """Groups [0, 1] and [2, 3]: in [0, 1] all_reduce of 10 float32 on rank 0 and of 11 on
    rank 1, both on stream 0; in [2, 3] the same on stream 1.  CollectiveMismatchError on every
    rank, found by the per-stream fingerprint check (well before the timeout)."""
    timeout = 40
    results = run_ranks("tests.workers_subgroups:stream_mismatch", 4, args={"impl": "dptc"},
                        env={"DPTC_TIMEOUT": str(timeout)}, timeout=90, expect_failure=True)
    for rank, result in enumerate(results):
        assert result["error_type"] == "CollectiveMismatchError", (rank, result)
        assert "DistError" in result["error_mro"], (rank, result)
        missing = [p for p in (r"\b10\b", r"\b11\b") if not re.search(p, result["error"])]
        assert not missing, f"rank {rank}: message {result['error']!r} lacks {missing}"
        assert result["elapsed"] < timeout / 4, (rank, result)
