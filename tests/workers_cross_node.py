"""Rank-side functions for tests/test_cross_node.py: groups that span (simulated) nodes.

Run through tests._launch.run_ranks(..., nnodes=2): GROUP_RANK tells the nodes apart, so ranks
0-1 are node 0 and ranks 2-3 node 1; between nodes dptc's bridge moves bytes with gloo
(dptc/group.py, _make_bridge).  Failure functions time the failing collective only:
tests._rank.start_clock() runs right after a barrier every rank leaves at about the same moment.
"""

import os
import signal
import time

import torch

from tests._rank import start_clock

# Seconds rank 0 (abort) or rank 1 (SIGKILL) waits after the barrier before it acts, so that the
# others are already blocked in their collective.
ACT_AFTER_S = 1.0
# How long a rank stays alive after its collective at most, waiting for the others (_observe).
LINGER_S = 15.0
NUMEL = 1 << 16


def _store():
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


def _ready():
    """Initialises dptc, runs one cross-node collective and the barrier; starts the clock."""
    import dptc
    pg = dptc.group.default_group()
    warm = torch.ones(8)
    dptc.all_reduce(warm)
    assert warm[0].item() == pg.size
    dptc.barrier()
    start_clock()
    return dptc, pg


def _observe(pg, collective, expected):
    """Runs `collective` and returns what it did as a dict: error_type, error_mro, error (None
    when it returned) and after, the seconds from the clock start (see _ready) to its return or
    raise.  Then stays alive until every rank in `expected` has observed its own (at most
    LINGER_S): a rank that exits right after raising closes its gloo connections, and the peer
    waiting on one would report the closed connection instead of what the test provokes."""
    from tests import _rank
    record = {"error_type": None, "error_mro": [], "error": None}
    try:
        collective()
    except Exception as error:  # noqa: BLE001 - reported to the test, which asserts on it
        record.update(error_type=type(error).__name__, error=str(error),
                      error_mro=[cls.__name__ for cls in type(error).__mro__])
    record["after"] = time.monotonic() - _rank._clock_start
    store = _store()
    store.set(f"done/{pg.rank}", "1")
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        if store.check([f"done/{r}" for r in expected]):
            break
        time.sleep(0.05)
    return record


def abort_while_blocked():
    """Rank 0 aborts the group ACT_AFTER_S after the barrier while ranks 1-3 wait in an
    all_reduce rank 0 never joins.  Every rank returns an _observe record; rank 0's "after" is
    when it called abort."""
    dptc, pg = _ready()
    everyone = range(pg.size)
    if pg.rank == 0:
        def act():
            time.sleep(ACT_AFTER_S)
            pg.abort("test abort")
        return _observe(pg, act, everyone)
    return _observe(pg, lambda: dptc.all_reduce(torch.ones(NUMEL)), everyone)


def killed_while_blocked(victim: int):
    """Rank `victim` SIGKILLs itself ACT_AFTER_S after the barrier; the others are in an
    all_reduce it never joins.  The survivors return _observe records."""
    dptc, pg = _ready()
    if pg.rank == victim:
        time.sleep(ACT_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached
    survivors = [r for r in range(pg.size) if r != victim]
    return _observe(pg, lambda: dptc.all_reduce(torch.ones(NUMEL)), survivors)


def failing_bridge(victim: int):
    """On rank `victim` only, stream 0's cross-node step raises ValueError; every rank then
    runs one all_reduce and returns an _observe record."""
    import dptc.group
    # set_bridge drops the bridge it replaces, and with it the last reference to that stream's
    # gloo group: its connections would close, and its peer on the other node would raise
    # gloo's "Connection reset" at once, which is not what this test provokes.  Keep them.
    kept, make = [], dptc.group._cross_group

    def cross_group(*args, **kwargs):
        kept.append(make(*args, **kwargs))
        return kept[-1]

    dptc.group._cross_group = cross_group
    dptc, pg = _ready()
    if pg.rank == victim:
        def broken(*args):
            raise ValueError("injected bridge failure")
        # The group is built with its bridges installed (group._open_engine); set_bridge
        # replaces stream 0's.  No collective is in flight on this rank now.
        pg._c.set_bridge(0, broken)
    start_clock()
    return _observe(pg, lambda: dptc.all_reduce(torch.ones(NUMEL)), range(pg.size))


# ---------------------------------------------------------------------------------------------
# Many rounds

def _ints(count, rank, salt):
    """Integer-valued float32 in [0, 40): sums over a few ranks are exact."""
    index = torch.arange(count, dtype=torch.int64)
    return ((index * (2 * salt + 1) + 3 * rank + salt) % 37).to(torch.float32)


def many_rounds(count: int):
    """Every collective on `count` float32 elements, with whatever DPTC_SLOT_BYTES is set:
    returns the failures (empty when every result is exact)."""
    import dptc
    rank, world = dptc.get_rank(), dptc.get_world_size()
    failures = []

    def expect(name, got, want):
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            first = bad[0].item() if bad.numel() else -1
            failures.append(f"{name}: {bad.numel()} of {want.numel()} elements wrong, first at "
                            f"{first}: {got.view(-1)[first].item() if first >= 0 else None} != "
                            f"{want.view(-1)[first].item() if first >= 0 else None}")

    # all_reduce, SUM and AVG (AVG divides by 4: a power of two, exact).
    for op, name in ((dptc.ReduceOp.SUM, "SUM"), (dptc.ReduceOp.AVG, "AVG")):
        tensor = _ints(count, rank, 1)
        dptc.all_reduce(tensor, op=op)
        want = sum(_ints(count, r, 1) for r in range(world))
        expect(f"all_reduce {name}", tensor, want / world if name == "AVG" else want)

    # broadcast from every rank.
    for src in range(world):
        tensor = _ints(count, rank, 2) if rank == src else torch.full((count,), -1.0)
        dptc.broadcast(tensor, src=src)
        expect(f"broadcast src={src}", tensor, _ints(count, src, 2))

    # all_gather_into_tensor.
    output = torch.full((world * count,), -1.0)
    dptc.all_gather_into_tensor(output, _ints(count, rank, 3))
    expect("all_gather_into_tensor", output, torch.cat([_ints(count, r, 3) for r in range(world)]))

    # reduce_scatter_tensor, SUM and AVG.
    for op, name in ((dptc.ReduceOp.SUM, "SUM"), (dptc.ReduceOp.AVG, "AVG")):
        out = torch.full((count,), -1.0)
        dptc.reduce_scatter_tensor(out, _ints(world * count, rank, 4), op=op)
        total = sum(_ints(world * count, r, 4) for r in range(world))
        want = total[rank * count:(rank + 1) * count]
        expect(f"reduce_scatter_tensor {name}", out, want / world if name == "AVG" else want)

    # all_gather_into_tensors: pieces of several sizes, one of them tiny.
    sizes = [count // 2, 3, count - count // 2 - 3]
    source = _ints(count, rank, 5)
    outputs = [torch.full((world * n,), -1.0) for n in sizes]
    dptc.all_gather_into_tensors(outputs, source)
    for j, n in enumerate(sizes):
        start = sum(sizes[:j])
        want = torch.cat([_ints(count, r, 5)[start:start + n] for r in range(world)])
        expect(f"all_gather_into_tensors output {j} ({n} per rank)", outputs[j], want)

    # Float reduce_scatter AVG: normwise within 1e-6 of the float64 average.
    generator = torch.Generator().manual_seed(1000 + rank)
    source = torch.randn(world * count, generator=generator)
    everyone = [torch.randn(world * count, generator=torch.Generator().manual_seed(1000 + r))
                for r in range(world)]
    out = torch.empty(count)
    dptc.reduce_scatter_tensor(out, source, op=dptc.ReduceOp.AVG)
    want = (sum(t.double() for t in everyone) / world)[rank * count:(rank + 1) * count]
    error = ((out.double() - want).abs().max() / want.abs().max()).item()
    if not error < 1e-6:
        failures.append(f"float reduce_scatter_tensor AVG: max relative difference {error:.3g}")
    nnodes = dptc.group.default_group().nnodes
    dptc.destroy_process_group()
    import threading
    watchers = [t.name for t in threading.enumerate() if t.name.startswith("dptc-")]
    return {"failures": failures, "float_rs_avg_rel_diff": error, "nnodes": nnodes,
            "watchers_after_destroy": watchers}


# ---------------------------------------------------------------------------------------------
# What the reduce-scatter sends across nodes

def reduce_scatter_traffic(numel: int):
    """Counts the gloo calls and bytes of one reduce_scatter_tensor of `numel` float32 inputs.

    ProcessGroupGloo.alltoall_base and .allreduce are wrapped before dptc builds its cross-node
    groups.  Returns {"alltoall": [calls, input bytes, output bytes], "allreduce": [calls,
    bytes], "slot_bytes": ..., "exact": bool} for the reduce-scatter alone, and the same for one
    all_reduce of the same input (showing that the counters see allreduce calls)."""
    import torch.distributed as dist

    counts = {"alltoall": [0, 0, 0], "allreduce": [0, 0]}
    gloo = dist.ProcessGroupGloo
    original_alltoall, original_allreduce = gloo.alltoall_base, gloo.allreduce

    def alltoall_base(self, output, input, *args, **kwargs):
        counts["alltoall"][0] += 1
        counts["alltoall"][1] += input.numel() * input.element_size()
        counts["alltoall"][2] += output.numel() * output.element_size()
        return original_alltoall(self, output, input, *args, **kwargs)

    def allreduce(self, tensors, *args, **kwargs):
        counts["allreduce"][0] += 1
        counts["allreduce"][1] += sum(t.numel() * t.element_size() for t in tensors)
        return original_allreduce(self, tensors, *args, **kwargs)

    gloo.alltoall_base = alltoall_base
    gloo.allreduce = allreduce

    import dptc
    pg = dptc.group.default_group()
    rank, world = pg.rank, pg.size
    dptc.barrier()
    count = numel // world

    def reset():
        counts["alltoall"][:] = [0, 0, 0]
        counts["allreduce"][:] = [0, 0]

    reset()
    source = _ints(numel, rank, 6)
    out = torch.empty(count)
    dptc.reduce_scatter_tensor(out, source)
    rs = {key: list(value) for key, value in counts.items()}
    total = sum(_ints(numel, r, 6) for r in range(world))
    exact = torch.equal(out, total[rank * count:(rank + 1) * count])

    reset()
    tensor = source.clone()
    dptc.all_reduce(tensor)
    ar = {key: list(value) for key, value in counts.items()}
    exact = exact and torch.equal(tensor, total)
    return {"reduce_scatter": rs, "all_reduce": ar, "exact": exact,
            "nnodes": pg.nnodes, "local_size": pg.local_size}


def uneven_groups():
    """Groups spanning the two nodes with unequal members per node, [0, 1, 2] and [1, 2, 3]:
    every collective against the math (integer-valued floats, exact).  Returns the failures
    and, per group, the layout dptc chose."""
    import torch.distributed as dist

    import dptc

    rank = dptc.get_rank()
    failures, layouts = [], {}
    for members in ([0, 1, 2], [1, 2, 3]):
        group = dptc.new_group(members)
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        n, me = len(members), members.index(rank)
        layouts[str(members)] = [group.rank, group.size, group.node, group.nnodes,
                                 group.local_size]
        count = 1001
        t = _ints(count, rank, 1).float()
        expected = sum(_ints(count, r, 1).float() for r in members)
        dptc.all_reduce(t, group=group)
        if not torch.equal(t, expected):
            failures.append(f"{members}: all_reduce differs")
        for src in members:
            b = _ints(count, rank, 2).float()
            dptc.broadcast(b, src=src, group=group)
            if not torch.equal(b, _ints(count, src, 2).float()):
                failures.append(f"{members}: broadcast from {src} differs")
        out = torch.empty(n * count)
        dptc.all_gather_into_tensor(out, _ints(count, rank, 3).float(), group=group)
        if not torch.equal(out, torch.cat([_ints(count, r, 3).float() for r in members])):
            failures.append(f"{members}: all_gather differs")
        full = {r: _ints(n * count, r, 4).float() for r in members}
        block = torch.empty(count)
        dptc.reduce_scatter_tensor(block, full[rank], group=group)
        want = sum(full[r] for r in members)[me * count:(me + 1) * count]
        if not torch.equal(block, want):
            failures.append(f"{members}: reduce_scatter block {me} differs")
        dptc.barrier(group=group)
    dptc.barrier()
    return {"failures": failures, "layouts": layouts}


def init_with_hand_set_layout():
    """dptc's first call in a process whose launch variables were set by hand; returns what it
    did: error_type, error (None when it initialised) and after, its seconds."""
    import dptc
    start = time.monotonic()
    record = {"error_type": None, "error": None}
    try:
        dptc.init_process_group()
        dptc.barrier()
    except Exception as error:  # noqa: BLE001 - reported to the test, which asserts on it
        record.update(error_type=type(error).__name__, error=str(error))
    record["after"] = time.monotonic() - start
    return record
