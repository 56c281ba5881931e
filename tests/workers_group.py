"""Rank-side functions for tests/test_group.py: the process-group layer."""

import datetime
import os
import socket
import time

import torch

from tests._rank import start_clock


def stuck_peer(stall: float):
    """Rank 1 stays alive but never arrives; rank 0 must raise DistTimeoutError in time."""
    import dptc
    rank = dptc.get_rank()
    dptc.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(stall)
        return "slept"
    start_clock()
    dptc.all_reduce(torch.ones(4))
    return "completed"


def raised(call):
    """The type name of what call() raises, or None."""
    try:
        call()
    except Exception as caught:  # noqa: BLE001 - the type is the result
        return type(caught).__name__
    return None


def reinit_and_info(use_torch_init: bool):
    """Rank/size queries, destroy and a second initialisation with a working engine; between
    them, a collective raises torch's ValueError at once (no group to start again in silence)."""
    import torch.distributed as dist
    import dptc
    if use_torch_init:
        dist.init_process_group("gloo")
    results = {"initialized_before": dptc.is_initialized()}
    results["rank"], results["size"] = dptc.get_rank(), dptc.get_world_size()
    results["initialized_after"] = dptc.is_initialized()
    pg = dptc.group.default_group()
    results["layout"] = [pg.node, pg.nnodes, pg.local_rank, pg.local_size]
    sums = []
    rank = dptc.get_rank()
    for round in range(2):
        t = torch.full((5,), float(rank + 1))
        if round:
            began = time.monotonic()
            try:
                dptc.all_reduce(t)
                sums.append("no error")
            except ValueError as error:
                sums.append([type(error).__name__, str(error)[:46],
                             time.monotonic() - began < 1.0])
            try:    # an init that fails leaves the group destroyed
                dptc.init_process_group(backend="nccl")
            except ValueError:
                pass
            sums.append(raised(lambda: dptc.get_rank()))
            dptc.init_process_group()
        dptc.all_reduce(t)
        sums.append(t[0].item())
        # torch's WORLD names the default group, as in torch
        dptc.destroy_process_group(dist.group.WORLD if round else None)
        sums.append(dptc.is_initialized())
    # torch.distributed stays up: the script's own, or the one dptc set up (torn down at exit).
    results["torch_initialized_at_end"] = dist.is_initialized()
    results["sums"] = sums
    return results


def use_after_torch_reinit():
    """dptc's destroy, then the script's own torch.distributed destroy and init: dptc starts
    again on first use from the new torch group, as it does on a script's first call."""
    import torch.distributed as dist
    import dptc
    dist.init_process_group("gloo")
    t = torch.ones(3)
    dptc.all_reduce(t)
    # Another port, from rank 0: torch's own re-initialisation on MASTER_PORT races with rank
    # 0's old store.
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        with socket.socket() as sock:
            sock.bind((os.environ["MASTER_ADDR"], 0))
            store.set("next_port", str(sock.getsockname()[1]))
    port = int(store.get("next_port"))
    dist.barrier()
    dptc.destroy_process_group()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
                            rank=int(os.environ["RANK"]), world_size=2)
    dptc.all_reduce(t)
    return t.tolist()


def wait_with_timedelta():
    import dptc
    t = torch.ones(1000)
    work = dptc.all_reduce(t, async_op=True)
    done = work.wait(timeout=datetime.timedelta(seconds=10))
    return [done, work.is_completed(), t[0].item()]


def single_process():
    """No torchrun environment at all: one rank, and every collective is an identity."""
    import dptc
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name not in os.environ, name
    t = torch.arange(6, dtype=torch.float32)
    dptc.all_reduce(t, op=dptc.ReduceOp.AVG)
    out = torch.empty(6)
    dptc.all_gather_into_tensor(out, t)
    return [dptc.get_world_size(), t.tolist(), out.tolist()]


def reinit_after_torch_destroy(lag: float = 0.0):
    """dptc's init, torch's destroy (a tutorial's cleanup()), dptc's init again: a working
    dptc group over a working torch.distributed, twice.  Rank 0 sleeps `lag` seconds before
    each destroy, so that rank 1 comes round to MASTER_PORT while rank 0 still serves the last
    initialisation's store ([Note: the last store] in dptc/group.py)."""
    import time
    import torch.distributed as dist
    import dptc
    sums = []
    for _ in range(3):
        dptc.init_process_group("gloo")
        t = torch.full((3,), float(dptc.get_rank() + 1))
        dptc.all_reduce(t)
        box = [dptc.get_rank()]
        dist.broadcast_object_list(box, src=1)
        sums.append([t[0].item(), box[0], dist.is_initialized()])
        if dptc.get_rank() == 0:
            time.sleep(lag)
        dist.destroy_process_group()
    return sums


def forked_child_leaves(how: str):
    """Rank 0 forks a child that leaves as `how` says, while the group trains on: "destroy"
    (dptc.destroy_process_group), "exit" (the interpreter's exit handlers) or "raise" (an
    uncaught exception, then the exit handlers).  The child is no member: the group must go on
    as if it never existed ([Note: forked children] in csrc/module.c).  Returns both
    all-reduce sums and, on rank 0, the child's exit status."""
    import atexit
    import sys
    import dptc
    rank = dptc.get_rank()
    t = torch.ones(8)
    dptc.all_reduce(t)
    result = {"sums": [t[0].item()]}
    if rank == 0:
        pid = os.fork()
        if pid == 0:   # the child: never returns into the harness's code
            try:
                if how == "destroy":
                    dptc.destroy_process_group()
                elif how == "raise":
                    try:
                        raise RuntimeError("the forked child failed")
                    except RuntimeError:
                        sys.excepthook(*sys.exc_info())
                if how in ("exit", "raise"):
                    atexit._run_exitfuncs()
            finally:
                os._exit(0)
        result["child"] = _wait_child(pid, 30)
    result["sums"].append(_sum_after(rank))
    return result


def forked_child_drops_a_work(late: float):
    """Rank 0 forks while its async all_reduce waits for rank 1 (`late` seconds late); the
    child drops its copy of the Work and leaves.  The child must not wait for a completion
    nobody posts there, nor abort the group at its deadline ([Note: forked children] in
    csrc/module.c).  Returns the sums of that all_reduce and of one after the child left and,
    on rank 0, the child's exit status and whether the work was still pending at the fork."""
    import gc
    import dptc
    rank = dptc.get_rank()
    t = torch.full((8,), float(rank + 1))
    if rank == 1:
        time.sleep(late)
        dptc.all_reduce(t)
        return {"sums": [t[0].item(), _sum_after(rank)]}
    work = dptc.all_reduce(t, async_op=True)
    pending = not work.is_completed()
    pid = os.fork()
    if pid == 0:
        try:
            del work
            gc.collect()
        finally:
            os._exit(0)
    child = _wait_child(pid, 60)
    work.wait()
    return {"sums": [t[0].item(), _sum_after(rank)], "child": child, "pending_at_fork": pending}


def _wait_child(pid, seconds):
    """The forked child's exit status, or "hung for <seconds> s" after killing it then."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return f"hung for {seconds} s"
        time.sleep(0.02)


def _sum_after(rank):
    import dptc
    t = torch.full((8,), float(rank + 1))
    dptc.all_reduce(t)
    return t[0].item()


def torch_groups_at_exit(mesh: str):
    """What dptc's exit handler leaves of torch's gloo groups, which dptc set up itself: the
    number of gloo worker threads (named pt_gloo_runloop) before and after the handler runs,
    with the model (and mesh) still held, as a script's globals are.

    mesh="default": fully_shard on dptc's default mesh, then DTensor.full_tensor (gloo work
    through the mesh, as a script's last evaluation or checkpoint does).  mesh="hsdp": a
    (1, world) mesh made with init_device_mesh, fully_shard on it, then full_tensor.
    mesh="fsdp1": FullyShardedDataParallel (its units' meshes and `process_group`)."""
    import dptc
    import dptc.group
    from torch.distributed.device_mesh import init_device_mesh
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    held = None
    if mesh == "fsdp1":
        model = dptc.FullyShardedDataParallel(model, device_id="cpu")
    else:
        if mesh == "hsdp":
            dptc.init_process_group()
            held = init_device_mesh("cpu", (1, dptc.get_world_size()),
                                    mesh_dim_names=("replicate", "shard"))
        for layer in model:
            dptc.fully_shard(layer, mesh=held)
        dptc.fully_shard(model, mesh=held)
    model(torch.ones(4, 8)).sum().backward()
    if mesh == "fsdp1":
        worked = model.process_group.size() == dptc.get_world_size()
    else:
        worked = all(p.full_tensor().isfinite().all() for p in model.parameters())
    before = _gloo_threads()
    dptc.group._shutdown()     # what atexit runs
    return {"before": before, "after": _gloo_threads(), "worked": bool(worked)}


def _gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:       # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")
