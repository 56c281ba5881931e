"""Rank-side bodies of tests/test_soak.py: models built, trained a step and dropped in a loop.

A sweep, an evaluation copy or a test suite builds many wrapped models in one process; each one
dropped (``del model, opt; gc.collect()``) must give back what it held.  For each kind
(fully_shard on every block and the root, FullyShardedDataParallel over the blocks, DDP over
the world, DDP over a dptc.new_group made for that model alone), ``drop_case`` builds the small
GPT of tests/workers_fsdp.py, wraps it, trains one AdamW step on this rank's rows, drops it,
and counts this process's memory maps (/proc/self/maps lines) and open file descriptors, round
after round; at the end, how many of the wrapped models are still alive.  The counts are the
result; the test judges them.
"""

import gc
import os
import time
import weakref

import torch

from examples.gpt import Block
from tests.workers_fsdp import _build, _finish

__all__ = ["drop_case"]

ROWS = 4
LR = 1e-3


def _maps():
    with open("/proc/self/maps", "rb") as file:
        return file.read().count(b"\n")


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _wrap(kind, model, group):
    """The model wrapped as `kind`; `group` is the dptc.new_group of kind "new_group"."""
    import dptc
    if kind == "fully_shard":
        for block in model.blocks:
            dptc.fully_shard(block)
        return dptc.fully_shard(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return dptc.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                             use_orig_params=True, device_id="cpu")
    if kind == "ddp":
        return dptc.DistributedDataParallel(model)
    if kind == "new_group":
        return dptc.DistributedDataParallel(model, process_group=group)
    raise ValueError(f"kind must be fully_shard, fsdp1, ddp or new_group, got {kind!r}")


def _gpt(model):
    return model if hasattr(model, "loss") else model.module


def _round(kind, rank, world, step, alive):
    import dptc
    # A sweep whose models each train over a group of their own: the group goes with them.
    group = dptc.new_group(list(range(world))) if kind == "new_group" else None
    model = _wrap(kind, _build("gpt"), group)
    alive.append(weakref.ref(model))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (ROWS * world, 9), generator=generator)[rank * ROWS:(rank + 1) * ROWS]
    loss = _gpt(model).loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.item()
    del model, opt, loss, group
    gc.collect()
    return value


def _drops(kind, rank, world, rounds):
    alive, maps, fds, losses = [], [], [], []
    for step in range(rounds):
        losses.append(_round(kind, rank, world, step, alive))
        maps.append(_maps())
        fds.append(_fds())
    return {"maps": maps, "fds": fds, "losses": losses,
            "alive": sum(ref() is not None for ref in alive)}


def drop_case(rounds):
    """{kind: per round, after the drop, this process's maps and fds, and the round's loss;
    the wrapped models still alive at the end}, for each kind of `rounds`, a dict of kind to
    the number of rounds, in its order."""
    import dptc
    rank, world = dptc.get_rank(), dptc.get_world_size()
    result = {}
    for kind, count in rounds.items():
        start = time.monotonic()
        result[kind] = _drops(kind, rank, world, count)
        result[kind]["seconds"] = time.monotonic() - start
    _finish("dptc")
    return result


def open_limit_case():
    """Rank 1 opens dptc's default group with no file descriptor to spare (torch.distributed's
    gloo group already up); every rank reports what it raised and how long it took."""
    import resource

    import torch.distributed as dist

    import dptc
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if rank == 1:
        # _fds() counts the descriptor its own listing opens: that one is the spare taken.
        resource.setrlimit(resource.RLIMIT_NOFILE, (_fds() - 1, limits[1]))
    start = time.monotonic()
    try:
        dptc.init_process_group()
        raised = None
    except dptc.DistError as error:
        raised = [type(error).__name__, str(error)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    seconds = time.monotonic() - start
    dptc.destroy_process_group()
    return {"raised": raised, "seconds": seconds}
