"""Rank-side functions for tests/test_cross_node_ddp.py: DDP over two (simulated) nodes.

Run through tests._launch.run_ranks(..., nnodes=2): ranks 0-1 are node 0, ranks 2-3 node 1.
The clock and the records are tests/workers_cross_node.py's (_ready, _observe).
"""

import time

import torch

from tests.workers_cross_node import ACT_AFTER_S, _observe, _ready


def ddp_step_with_an_aborted_peer(victim: int):
    """Rank `victim` aborts the world ACT_AFTER_S after the barrier, while the others run a
    DDP backward whose buckets cross the nodes.  Every rank returns an _observe record."""
    import dptc
    torch.manual_seed(0)
    model = dptc.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)))
    _, pg = _ready()
    everyone = range(pg.size)
    if pg.rank == victim:
        def act():
            time.sleep(ACT_AFTER_S)
            pg.abort("test abort on node 1")
        return _observe(pg, act, everyone)
    batch = torch.randn(8, 64, generator=torch.Generator().manual_seed(pg.rank))
    return _observe(pg, lambda: model(batch).sum().backward(), everyone)


def uncaught_then_exit(victim: int):
    """Rank `victim` fails ACT_AFTER_S after the barrier as a script's uncaught exception ends
    it: sys.excepthook (dptc's aborts every group), then the process is gone at once
    (os._exit, as a process killed right after its traceback is printed).  The others wait in
    an all_reduce it never joins and return _observe records."""
    import os
    import sys

    _, pg = _ready()
    if pg.rank == victim:
        time.sleep(ACT_AFTER_S)
        try:
            raise RuntimeError("victim raised")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
        os._exit(1)
    import dptc
    survivors = [r for r in range(pg.size) if r != victim]
    return _observe(pg, lambda: dptc.all_reduce(torch.ones(1 << 16)), survivors)


def killed_in_a_cross_node_pair():
    """HSDP's replicate groups as new_group([0, 2]) and new_group([1, 3]).  Rank 3 SIGKILLs
    itself ACT_AFTER_S after the barrier while rank 1 waits on it in an all_reduce over
    [1, 3] and ranks 0 and 2 wait in an all_reduce over the world.  Survivors return _observe
    records."""
    import os
    import signal

    import dptc
    _, pg = _ready()
    pairs = [dptc.new_group([0, 2]), dptc.new_group([1, 3])]
    dptc.barrier()
    from tests._rank import start_clock
    start_clock()
    if pg.rank == 3:
        time.sleep(ACT_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)
    if pg.rank == 1:
        return _observe(pg, lambda: dptc.all_reduce(torch.ones(1 << 16), group=pairs[1]),
                        [1, 2])
    return _observe(pg, lambda: dptc.all_reduce(torch.ones(1 << 16)), [1, 2])
