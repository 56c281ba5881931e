"""Named ranges in torch.profiler traces: dptc's collectives and wrapper phases.

[Note: profiler ranges]
While a torch profiler records, dptc opens a range (a RecordFunction, as
``torch.profiler.record_function`` does) around each collective it runs and each phase of its
wrappers, so traces and ``key_averages()`` show where the step waits for communication:

    dptc::all_reduce, dptc::broadcast, dptc::all_gather, dptc::reduce_scatter, dptc::barrier
        the collectives of dptc/collectives.py; a blocking call's range spans the whole
        collective, an ``async_op=True`` call's range its launch only (the handle may be waited
        on any thread, or never)
    dptc::all_reduce bucket <k>
        DDP's all-reduce of bucket k, numbered in launch order as the reducer (and torch's
        DDP) numbers them: bucket 0 holds the gradients ready first.  Opened when the bucket is
        launched, closed when the reducer observes its completion: at the next gradient hook
        after it completed, or in the end-of-backward wait (csrc/reducer.c)
    dptc::ddp finalize
        DDP's end-of-backward callback: launching what is left, waiting, writing .grad
    dptc::all_gather <unit>, dptc::reduce_scatter <unit>, dptc::all_reduce <unit>
        fully_shard: a unit's gather, from its launch (a prefetch, or the unit's own pre-forward
        or pre-backward) until the wait that puts the parameters on the module; its gradients'
        reduce-scatter, from launch until the wait that accumulates them; and for HSDP the
        all-reduce across replicas that follows.  One range per dtype bucket of the unit (one
        for a unit whose parameters share a dtype).  <unit> is the unit's module's qualified
        name from the root, e.g. ``blocks.2``; the root itself is ``root``; a unit of several
        modules joins their names with ``,``; before the first forward names the class
    dptc::fsdp finalize
        fully_shard's end-of-backward callback: waiting for the reductions, accumulating them

A range is opened and closed on the same thread (the autograd thread, for ranges that span a
backward): ranges of wrapper work may overlap autograd's own ranges instead of nesting inside
them, which torch's profiler records as they are.

Cost when no profiler records: one read of ``torch.autograd.profiler._is_profiler_enabled``
per collective or transition (a module attribute in Python, a dict lookup in C).  The C core
calls back into Python (``open_range`` and ``close_range`` below, handed to it by ``install``)
only while that flag is set, and never from the engine or its transports.
"""

import torch
import torch.autograd.profiler

from . import _C
from ._dtypes import OP_ALL_GATHER, OP_ALL_REDUCE, OP_BARRIER, OP_BROADCAST, OP_REDUCE_SCATTER

__all__ = ["COLLECTIVE_NAMES", "flags", "open_range", "close_range", "Range", "install"]

# Range names of the plain collectives, by operation code.
COLLECTIVE_NAMES = {
    OP_ALL_REDUCE: "dptc::all_reduce",
    OP_BROADCAST: "dptc::broadcast",
    OP_ALL_GATHER: "dptc::all_gather",
    OP_REDUCE_SCATTER: "dptc::reduce_scatter",
    OP_BARRIER: "dptc::barrier",
}

# The module whose _is_profiler_enabled is True while a torch profiler records (set and cleared
# by torch.profiler.profile and torch.autograd.profiler.profile as they start and stop).
flags = torch.autograd.profiler

_enter = torch.ops.profiler._record_function_enter_new
_exit = torch.ops.profiler._record_function_exit._RecordFunction


def open_range(name):
    """Opens the range `name` on this thread; returns its handle for close_range()."""
    return _enter(name, None)


def close_range(handle):
    """Closes a range open_range() returned (None: nothing to close)."""
    if handle is not None:
        _exit(handle)


class Range:
    """``with Range(name):`` a range around the block while a profiler records; nothing
    otherwise."""

    __slots__ = ("name", "handle")

    def __init__(self, name):
        self.name = name
        self.handle = None

    def __enter__(self):
        if flags._is_profiler_enabled:
            self.handle = open_range(self.name)
        return self

    def __exit__(self, *exc_info):
        handle, self.handle = self.handle, None
        close_range(handle)


def install():
    """Hands the C core the flag, open_range and close_range, for the ranges it opens itself
    (DDP buckets, fully_shard units).  Called at import; again after replacing either."""
    _C.set_profiler(vars(flags), "_is_profiler_enabled", open_range, close_range)


install()
