"""Rank-side functions for tests/test_node_layout.py: node layouts from a launch environment
set by hand (run through tests._launch.run_ranks with `env` overrides)."""

import torch


def layout():
    """Initialises dptc from the environment and runs one all_reduce over the world.  Returns
    the default group's layout and the sum of every rank's (rank + 1)."""
    import dptc
    tensor = torch.full((3,), float(dptc.get_rank() + 1))
    dptc.all_reduce(tensor)
    pg = dptc.group.default_group()
    return {"sum": tensor[0].item(), "node": pg.node, "nnodes": pg.nnodes,
            "local_rank": pg.local_rank, "local_size": pg.local_size}


def subgroup_peer_lost(how: str):
    """Every rank makes the group [2, 3], which lies on node 1 (a group of one node: its node
    index is 0).  Rank 3 aborts it ("abort") or SIGKILLs itself ("sigkill") a second after the
    barrier, while rank 2 waits in an all_reduce over it.  Rank 2 returns what it raised (type
    and message); the others return None once rank 2 has reported."""
    import os
    import signal
    import time

    import torch.distributed as dist

    import dptc
    rank = dptc.get_rank()
    group = dptc.new_group([2, 3])
    store = dist.distributed_c10d._get_default_store()
    dptc.barrier()
    result = None
    if rank == 3:
        time.sleep(1.0)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        group.abort("test abort")
    elif rank == 2:
        try:
            dptc.all_reduce(torch.ones(16), group=group)
            result = {"error_type": None, "error": None}
        except Exception as error:  # noqa: BLE001 - reported to the test
            result = {"error_type": type(error).__name__, "error": str(error)}
        store.set("rank2_done", "1")
    store.wait(["rank2_done"])
    return result


def hybrid_shard_on_uneven_nodes():
    """Three ranks as nodes of two and one (GROUP_RANK 0, 0, 1, as two torchrun invocations
    with --nproc-per-node 2 and 1 give them), set before dptc initialises: FSDP1 HYBRID_SHARD
    without process_group.  Returns what the constructor raised, or each rank's local share
    of the parameters."""
    import os

    import dptc
    rank = int(os.environ["RANK"])
    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"
    os.environ["LOCAL_RANK"] = str(rank if rank < 2 else 0)
    dptc.init_process_group()
    torch.manual_seed(0)
    try:
        model = dptc.FullyShardedDataParallel(
            torch.nn.Linear(8, 8), sharding_strategy=dptc.ShardingStrategy.HYBRID_SHARD,
            device_id=torch.device("cpu"))
    except ValueError as error:
        return {"error": str(error)}
    return {"local": sum(p.to_local().numel() for p in model.parameters())}
