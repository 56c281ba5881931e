"""Uneven inputs: the join context manager, over dptc's engine.

``with ddp.join():`` (or torch's ``Join([ddp, ...])``) lets ranks run out of inputs at
different steps.  A rank that has left the loop (has *joined*) stays in the context manager's
exit and, for every step the others still take, issues the collectives their DDP issues:
first an all-reduce that counts the ranks still training, then DDP's own (the bucket rebuild's
broadcast, the buffer broadcast, whether the backward syncs, one all-reduce of zeros per
bucket, the used-parameter map).  When every rank has joined, the model of the last rank to
join is broadcast to all.  That is torch's algorithm, step for step, so a script that trains
under torch's join trains to the same numbers under dptc's.

[Note: join counting transport]
The counting all-reduces (the joined rank's count and the training ranks' notification in
forward) must go over one transport on every rank.  The first joinable decides it: a dptc
DistributedDataParallel first in ``dptc.Join`` (what ``ddp.join()`` returns) counts over
dptc's engine, in its own group; anything else (torch's ``Join``, or a torch joinable such as
ZeroRedundancyOptimizer first) counts as torch's does, with torch.distributed on the
joinables' torch group.  The joinable learns which from the type of the ``_join_config`` the
context manager gives it (``_DptcJoinConfig`` for dptc's counting).
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as _TorchJoin
from torch.distributed.algorithms.join import JoinHook, Joinable, _JoinConfig

from .collectives import all_reduce
from .group import resolve

__all__ = ["Join", "JoinHook", "Joinable"]


class _DptcJoinConfig(_JoinConfig):
    """A _JoinConfig whose counting goes over dptc's engine (see [Note: join counting
    transport])."""
    __slots__ = ()


def _dptc_group(joinable):
    """The dptc group a dptc joinable counts in, or None for a torch joinable."""
    group = getattr(joinable, "_dptc_join_group", None)
    return group() if group is not None else None


class Join(_TorchJoin):
    """torch.distributed.algorithms.join.Join, counting over dptc's engine when its first
    joinable is dptc's (see [Note: join counting transport]).

    ``joinables`` may mix dptc's DistributedDataParallel with torch joinables (such as
    ZeroRedundancyOptimizer) over the same ranks; hooks run in the order given.
    """

    def _set_joinable_configs(self):
        if not self._joinables:
            raise ValueError("The join context manager requires at least one joinable")
        config = _DptcJoinConfig if _dptc_group(self._joinables[0]) is not None \
            else _JoinConfig
        for k, joinable in enumerate(self._joinables):
            joinable._join_config = config(
                enable=self._enable, throw_on_early_termination=self._throw_on_early_termination,
                is_first_joinable=k == 0)

    def _extract_dist_info(self):
        self._dptc = _dptc_group(self._joinables[0])
        if self._dptc is None:
            return super()._extract_dist_info()
        for joinable in self._joinables[1:]:
            group = _dptc_group(joinable) or resolve(joinable.join_process_group,
                                                     "join_process_group")
            if group is None or group.ranks != self._dptc.ranks:
                raise ValueError(
                    f"Using join context manager with multiple process groups: "
                    f"{type(joinable).__name__} joins over "
                    f"{'other ranks' if group is None else group.ranks}, "
                    f"{type(self._joinables[0]).__name__} over {self._dptc.ranks}; pass "
                    f"joinables of one group")
        self._process_group = self._joinables[0].join_process_group
        self._rank = self._dptc.rank
        self._device = self._joinables[0].join_device

    def _get_num_nonjoined_procs(self):
        if self._dptc is None:
            return super()._get_num_nonjoined_procs()
        count = torch.zeros(1)
        all_reduce(count, group=self._dptc)
        return count.item()

    def _notify_procs_to_terminate(self):
        if self._dptc is None:
            return super()._notify_procs_to_terminate()
        all_reduce(torch.ones(1), group=self._dptc)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")


def notify(joinable, group):
    """Tells the join context that this rank is still training (torch's
    Join.notify_join_context, over the transport its config names); returns (work, count): the
    all-reduce, or None once done, and the tensor that holds (once done) the number of ranks
    still training; or None when there is nothing to notify.  With
    throw_on_early_termination, raises RuntimeError on every rank once one of them has
    joined."""
    config = joinable._join_config
    if not config.is_first_joinable or not config.enable:
        return None
    dptc = isinstance(config, _DptcJoinConfig)
    if dptc:
        # Blocking: the calling thread runs it at once.  Left to the progress thread (async,
        # as torch's), it took cores from forward: dptc's DDP step under join() measured 2 to
        # 3 ms slower on 2 ranks (benchmarks/ddp_step.py --join, alternating runs).
        issue = lambda tensor, async_op: all_reduce(tensor, group=group, async_op=async_op)
        device = torch.device("cpu")
    else:
        # torch's Join: its group is the joinable's torch group (torch's Join refuses a dptc
        # group without one when it is made, naming torch.distributed.new_group).
        issue = lambda tensor, async_op: dist.all_reduce(
            tensor, group=joinable.join_process_group, async_op=async_op)
        device = joinable.join_device
    count = torch.ones(1, device=device)
    work = issue(count, not dptc)
    if config.throw_on_early_termination:
        joined = torch.zeros(1, device=device)
        issue(joined, False)
        if joined.item():
            if work is not None:
                work.wait()
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing "
                               "across all ranks.")
    return work, count


class DDPJoinHook(JoinHook):
    """DistributedDataParallel's join hook: while others train, a joined rank issues the
    collectives of their forward and backward; at the end, the last joiner's model wins."""

    def __init__(self, ddp, divide_by_initial_world_size):
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(f"divide_by_initial_world_size must be a bool, got "
                            f"{divide_by_initial_world_size!r}")
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self):
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner):
        self.ddp._sync_final_model(is_last_joiner)
