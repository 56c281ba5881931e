"""The staging slots hold nothing one collective leaves for the next ([Note: slots between
collectives] in csrc/shm.c): with local rank 0 overwriting every local rank's slots of a stream
with 0xFF bytes (NaN in every float dtype, -1 in every integer one) between any two collectives
on it, every result is the same, bit for bit, as without.

Layer: several ranks (rank code in tests/workers_slots.py).  Each case runs twice, with and
without the sentinel, and compares: every collective's result (bit for bit against the math,
and its digest between the runs), DDP's and fully_shard's trained parameters (digests between
the runs, and their distance from single-process training on the whole batch), and the number
of fills, which must be one per collective on a group with a peer.
"""

import pytest

from tests._launch import run_ranks

SEED = 2718
SENTINEL = 0xFF
TIMEOUT_S = 240
STAGED_FSDP = {"DPTC_FSDP_SHARED_GATHER": "0", "DPTC_FSDP_SHARED_REDUCE": "0"}


def _twice(target, world_size, args, **kwargs):
    """The ranks' results without and with the sentinel."""
    return [run_ranks(target, world_size, args={**args, "sentinel": sentinel},
                      timeout=TIMEOUT_S, **kwargs)
            for sentinel in (None, SENTINEL)]


@pytest.mark.parametrize("world_size, nnodes, staging, groups", [
    (2, 1, "cached", None),
    (2, 1, "streamed", None),
    (3, 1, "auto", None),
    # Across two simulated nodes: the bridge's byte ranges of the slots, and groups of one
    # rank a node (HSDP's replicate groups) beside one of two ranks on a node.
    (4, 2, "auto", [[0, 2], [1, 3], [0, 1]]),
])
def test_collectives_ignore_what_slots_held(world_size, nnodes, staging, groups):
    """all_reduce (999 elements: the small one; 1.3 M: the large one in rounds), in place on
    three pieces as DDP reduces, all_gather_into_tensor, all_gather_into_tensors (FSDP's several
    outputs), reduce_scatter_tensor, broadcast from the first and the last member, barrier, in
    float32, int64 and float64 on both streams, on the world and on subgroups: every result
    equals the math bit for bit and the run without the sentinel, and every collective on a
    group with a peer opened with a fill."""
    plain, filled = _twice("tests.workers_slots:collectives", world_size,
                           {"seed": SEED, "groups": groups}, nnodes=nnodes,
                           env={"DPTC_SHM_STAGING": staging})
    for rank in range(world_size):
        assert plain[rank]["failures"] == [], (rank, plain[rank]["failures"][:5])
        assert filled[rank]["failures"] == [], (rank, filled[rank]["failures"][:5])
        assert filled[rank]["digests"] == plain[rank]["digests"], rank
        assert len(plain[rank]["digests"]) >= 48, rank
        assert plain[rank]["fills"] == 0, (rank, plain[rank])
        assert filled[rank]["fills"] == filled[rank]["issued"] >= 53, (rank, filled[rank]["fills"])


def test_ddp_ignores_what_slots_held():
    """dptc's DDP over 4 SGD steps (gradients all-reduced as pieces during backward): the
    parameters are bit-identical with and without the sentinel, within 1e-5 of single-process
    training, and the sentinel run filled the slots before every one of its collectives."""
    plain, filled = _twice("tests.workers_slots:ddp", 2, {"seed": SEED, "steps": 4})
    for rank in range(2):
        assert filled[rank]["digest"] == plain[rank]["digest"] == plain[0]["digest"], rank
        assert filled[rank]["max_rel"] < 1e-5, filled[rank]
        assert plain[rank]["fills"] == 0 and filled[rank]["fills"] >= 4, (plain, filled)


@pytest.mark.parametrize("world_size, nnodes, env, scenarios", [
    # Gathers and reduce-scatters staged through the slots (private inputs), and under bf16.
    (2, 1, STAGED_FSDP, ["gpt", "gpt_nosync", "gpt_bf16"]),
    # HSDP's all-reduce across replicas, and resharding to blocks of 2 ranks after forward.
    (4, 1, {}, ["gpt_hsdp", "gpt_reshard2", "gpt_hsdp_bf16"]),
    # The same across two simulated nodes, staged: replicas on other nodes, through the bridge.
    (4, 2, STAGED_FSDP, ["gpt_hsdp", "gpt_reshard2"]),
])
def test_fully_shard_ignores_what_slots_held(world_size, nnodes, env, scenarios):
    """fully_shard training (3 steps of 2 micro-batches, clip_grad_norm_, AdamW): the trained
    parameters and losses are bit-identical with and without the sentinel, float64 scenarios
    within 1e-12 of single-process training, and the sentinel run filled the slots (the same
    number of times on every rank of a node)."""
    plain, filled = _twice("tests.workers_slots:fully_shard", world_size,
                           {"scenarios": scenarios}, nnodes=nnodes, env=env)
    for rank in range(world_size):
        for name in scenarios:
            a, b = plain[rank]["scenarios"][name], filled[rank]["scenarios"][name]
            assert b["digest"] == a["digest"], (rank, name)
            assert b["losses"] == a["losses"], (rank, name)
            if a["ref_rel"] is not None:
                assert a["ref_rel"] < 1e-12 and b["ref_rel"] < 1e-12, (rank, name, a, b)
        assert plain[rank]["fills"] == 0, plain[rank]
        assert filled[rank]["fills"] >= 20 * len(scenarios), filled[rank]["fills"]
    local = world_size // nnodes
    for node in range(nnodes):
        fills = {filled[rank]["fills"] for rank in range(node * local, (node + 1) * local)}
        assert len(fills) == 1, (node, fills)
