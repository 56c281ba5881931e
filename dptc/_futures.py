"""Work.result() and Work.get_future() for collectives on CPU tensors: torch's values, and a
future that completes when the collective does, whoever waits.

[Note: futures of works]
torch's Work.get_future() returns a torch.futures.Future that the backend completes from its
own thread when the collective finishes, so `.then()` callbacks run without anybody calling
wait(): DDP communication hooks return `all_reduce(..., async_op=True).get_future().then(...)`
and DDP waits for that chain at the end of backward.  dptc's engine completes works on its
progress threads, which never take the GIL; so the futures are completed by one Python thread
per process, the watcher, started at the first get_future() of a work still running:

- get_future() marks the work watched (see [Note: watched works] in csrc/engine.h) and hands it
  to the watcher, which sleeps (GIL released) on the engine's count of watched completions and
  completes each future when its work has completed: set_result with result()'s list, or
  set_exception with the exception work.wait() raises (PeerLostError, DistTimeoutError,
  CollectiveMismatchError, ...: the same type).  `.then()` callbacks run on the watcher, as
  torch's run on gloo's thread.  A work already completed gets its future completed at once,
  in the caller.  Works nobody asks a future of cost nothing more (one flag read in C).
- A work still not completed at its deadline (work._timeout, what wait() waits) is waited for
  by the watcher as wait() would: that aborts the group, and the future gets DistTimeoutError.
  The engine's own deadlines normally fail it first.
- Exit: the watcher is a daemon thread, stopped by an atexit handler registered when it starts,
  so it runs before group.py's (registered earlier) destroys the groups.  It never completes a
  future during the interpreter's finalisation, when a thread woken from a C++ wait (torch's
  Future.wait) would have to take the GIL and be ended by pthread_exit (see [Note: torch groups
  at exit] in group.py).  Futures still pending at exit stay pending; their works are released after the
  groups are destroyed, which completes them.
- Fork: a forked child (a DataLoader worker) has no watcher and no engine threads.  It forgets
  the parent's pending futures (they stay pending there) and never watches a work of the
  parent's: get_future() raises there (csrc/module.c), as waiting would end by aborting the
  parent's group ([Note: forked children] in csrc/module.c).

Values, as torch 2.13's gloo Work gives them (tests/test_work_future.py compares):
all_reduce and broadcast [tensor]; all_gather_into_tensor the output's per-rank pieces, each
shaped as the input (gloo chunks the output by rank); barrier []; reduce_scatter_tensor
[output] (gloo raises "not implemented" for both get_future and result; NCCL gives
[output]); dptc's several-output forms (all_gather_into_tensors) the list of outputs.  A
complex tensor's value is its (real, imaginary) view, as torch's.
"""

import atexit
import logging
import os
import threading
import time

import torch

from . import _C
from ._dtypes import OP_ALL_GATHER, OP_BARRIER

__all__ = ["result", "watch", "value"]

logger = logging.getLogger(__name__)

# Seconds the atexit handler gives a watcher that is running callbacks to stop.
_STOP_JOIN_S = 1.0

_lock = threading.Lock()
_pending = []           # [work, future, deadline]: watched works not yet completed
_thread = None          # the watcher, started on first need
_stopping = False       # set at exit
_left_by_parent = []    # a forked child's copy of its parent's _pending (never completed here)


def value(work, nccl=False):
    """The list torch's Work.result() and future hold for `work` (gloo's, or with `nccl`
    NCCL's, where an all-gather gives its whole output)."""
    op, input, output, size = work._parts()
    if op == OP_BARRIER:
        return []
    if isinstance(output, tuple):
        return list(output)
    if op == OP_ALL_GATHER and not nccl:
        return list(output.view((size,) + tuple(input.shape)).unbind(0))
    return [output]


def result(work):
    """Work.result() of a completed CPU work (csrc/module.c checked it)."""
    return value(work)


def _settle(work, future, deadline):
    """Completes `future` from `work`: completed, or past its deadline (then waiting as wait()
    does aborts the group and raises DistTimeoutError)."""
    left = deadline - time.monotonic()
    try:
        # A completed work returns (or raises its error) at once; 0 would mean the default.
        work.wait(timeout=max(left, 1e-3))
        outcome = value(work)
    except Exception as error:  # noqa: BLE001 - the collective's error goes to the future
        future.set_exception(error)
    else:
        future.set_result(outcome)


def watch(work):
    """A new future of `work` (Work.get_future), completed when the work completes."""
    global _thread
    future = torch.futures.Future()
    if work.is_completed():
        _settle(work, future, time.monotonic())
        return future
    work._watch()
    with _lock:
        _pending.append([work, future, time.monotonic() + work._timeout])
        if _thread is None and not _stopping:
            _thread = threading.Thread(target=_run, name="dptc-futures", daemon=True)
            _thread.start()
            # Registered now, so it runs before the handlers of dptc's groups (atexit runs the
            # last registered first), which were registered when a group was made.
            atexit.register(_stop)
    _C._watched_wake()
    return future


def _take_ready():
    """Removes and returns the pending entries whose work completed or whose deadline passed,
    and the earliest deadline left (None when nothing is pending).  Lock held."""
    now = time.monotonic()
    ready, waiting = [], []
    for entry in _pending:
        (ready if entry[0].is_completed() or entry[2] <= now else waiting).append(entry)
    _pending[:] = waiting
    return ready, min((entry[2] for entry in waiting), default=None)


def _run():
    while True:
        seen = _C._watched_count()
        with _lock:
            if _stopping:
                return
            ready, deadline = _take_ready()
        if ready:
            _settle_all(ready)   # a function: no reference to a work outlives it here
            del ready
        else:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            _C._watched_sleep(seen, left)


def _settle_all(ready):
    for work, future, deadline in ready:
        try:
            _settle(work, future, deadline)
        except Exception:  # noqa: BLE001 - one bad future must not stop the others
            logger.exception("dptc: completing the future of a collective failed")
    ready.clear()


def _stop():
    """atexit: stops the watcher before the groups are destroyed (see the note)."""
    global _stopping
    with _lock:
        _stopping = True
        thread = _thread
    _C._watched_wake()
    if thread is not None and thread is not threading.current_thread():
        thread.join(_STOP_JOIN_S)


def _after_fork_in_child():
    global _lock, _pending, _thread
    _lock = threading.Lock()
    _left_by_parent.extend(_pending)
    _pending = []
    _thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)
