"""Rank-side functions for tests/test_engine_edges.py: the engine's edges (csrc/engine.c,
csrc/module.c) - a wait that gives up, Ctrl-C, raw addresses, several threads on one group.

Each function catches what it expects and returns numbers (error types, messages, monotonic
timestamps, results); time.monotonic() is CLOCK_MONOTONIC, one clock for every process of the
machine, so the test can subtract timestamps taken by different ranks.
"""

import os
import signal
import threading
import time
from pathlib import Path

import torch

SENTINEL = -12345.0


def _error(error):
    return {"type": type(error).__name__, "message": str(error),
            "mro": [cls.__name__ for cls in type(error).__mro__]}


def _wait_for_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# 1. A wait that gives up on work queued behind other work

def wait_gives_up(flag_dir: str, late_s: float, count: int):
    """Rank 0 queues all_reduce(A) and all_reduce(B) and gives up waiting for B after 0.5 s;
    rank 1 issues the same two all_reduces only `late_s` seconds later.

    Rank 0 returns the timing and state right after the wait, then fills B with SENTINEL and
    returns B's contents once rank 1 is done, and what a further all_reduce does.  Rank 1 returns
    what its two (blocking) all_reduces raised and how long each took.
    """
    import dptc
    rank = dptc.get_rank()
    done_flag = Path(flag_dir) / "rank1-done"
    dptc.all_reduce(torch.ones(4))  # every rank is up and the group is initialised
    A = torch.full((count,), float(rank + 1))
    B = torch.full((count,), float(10 * (rank + 1)))
    if rank == 1:
        time.sleep(late_s)
        calls = []
        for tensor in (A, B):
            started = time.monotonic()
            try:
                dptc.all_reduce(tensor)
                calls.append({"error": None, "elapsed": time.monotonic() - started})
            except Exception as error:  # noqa: BLE001 - reported to the test
                calls.append({"error": _error(error), "elapsed": time.monotonic() - started})
        done_flag.touch()
        return {"calls": calls, "A": A[:4].tolist(), "B": B[:4].tolist()}

    wA = dptc.all_reduce(A, async_op=True)
    wB = dptc.all_reduce(B, async_op=True)
    started = time.monotonic()
    wait_error = None
    try:
        wB.wait(timeout=0.5)
    except Exception as error:  # noqa: BLE001
        wait_error = _error(error)
    wait_elapsed = time.monotonic() - started
    completed = {"A": wA.is_completed(), "B": wB.is_completed()}
    B.fill_(SENTINEL)
    # Rank 1 enters at about late_s; its collectives fail (or, on an engine that left B queued,
    # complete and write into B).  Look at B only once rank 1 is through, and not before late_s.
    _wait_for_file(done_flag, timeout=late_s + 15)
    time.sleep(max(0.0, started + late_s + 1.0 - time.monotonic()))
    B_wrong = int((B != SENTINEL).sum().item())
    later_started = time.monotonic()
    try:
        dptc.all_reduce(torch.ones(4))
        later_error = None
    except Exception as error:  # noqa: BLE001
        later_error = _error(error)
    later_elapsed = time.monotonic() - later_started
    return {"wait_error": wait_error, "wait_elapsed": wait_elapsed, "completed": completed,
            "B_wrong": B_wrong, "B_checked_at": later_started - started,
            "later_error": later_error, "later_elapsed": later_elapsed}


# ---------------------------------------------------------------------------------------------
# 2. Ctrl-C

def interrupted(mode: str, signal_after_s: float):
    """Rank 0 blocks in all_reduce on stream 0, rank 1 in all_reduce on stream 1: neither can
    complete.  A timer sends SIGINT to rank 0 itself after signal_after_s.

    mode="blocking": dptc.all_reduce(t) (runs on the calling thread, group_run);
    mode="async": dptc.all_reduce(t, async_op=True).wait() (the progress thread runs it, the main
    thread waits in work_wait).
    Returns {"signal_at", "raised_at": monotonic timestamps (signal_at on rank 0 only), "error"}.
    """
    import dptc
    if mode not in ("blocking", "async"):
        raise ValueError(f"mode must be 'blocking' or 'async', got {mode!r}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the launcher did
    rank = dptc.get_rank()
    dptc.all_reduce(torch.ones(4))  # every rank is up and the group is initialised
    tensor = torch.ones(1000)
    sent = {}
    if rank == 0:
        def send():
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)
        threading.Timer(signal_after_s, send).start()
    stream = 0 if rank == 0 else 1
    error = None
    try:
        if mode == "blocking":
            dptc.all_reduce(tensor, stream=stream)
        else:
            work = dptc.all_reduce(tensor, async_op=True, stream=stream)
            work.wait()
    except BaseException as caught:  # noqa: BLE001 - KeyboardInterrupt is the point
        error = _error(caught)
    raised_at = time.monotonic()
    if rank == 0:
        time.sleep(0.2)  # a late signal would land here, outside the collective
    return {"signal_at": sent.get("at"), "raised_at": raised_at, "error": error}


# ---------------------------------------------------------------------------------------------
# 3. Raw addresses

def raw_addresses():
    """Group.run given ints where tensors go; returns what each call raised."""
    import dptc
    c = dptc.group.default_group()._c
    outcomes = {}
    cases = {
        "both": (0, 0, 0, 12345, 12345, 1, 0, 0),
        "output": (0, 0, 0, torch.zeros(1), 12345, 1, 0, 0),
    }
    for name, args in cases.items():
        try:
            c.run(*args)
            outcomes[name] = None
        except Exception as error:  # noqa: BLE001
            outcomes[name] = _error(error)
    # The group still works afterwards.
    tensor = torch.full((3,), 2.5)
    dptc.all_reduce(tensor)
    outcomes["after"] = tensor.tolist()
    return outcomes


def all_reduce_pieces():
    """Group.run and Group.submit all-reducing a list of tensors in place (input None), the
    form FSDP uses over a shard group of one: each rank's pieces (uneven sizes, large enough
    to take the round-by-round path) hold rank-dependent values; returns the results and what
    the malformed calls raised."""
    import dptc
    from dptc._dtypes import OP_ALL_REDUCE, REDOP_AVG, REDOP_SUM, dtype_code
    rank = dptc.get_rank()
    c = dptc.group.default_group()._c
    sizes = (5, 70001, 3)
    code = dtype_code(torch.float64)

    def pieces():
        return [torch.arange(n, dtype=torch.float64) * (rank + 1) + k
                for k, n in enumerate(sizes)]
    summed, averaged = pieces(), pieces()
    c.run(OP_ALL_REDUCE, code, REDOP_SUM, None, summed, sum(sizes), 0, 0)
    c.submit(OP_ALL_REDUCE, code, REDOP_AVG, None, averaged, sum(sizes), 0, 0).wait()
    out = {"sum": [p.tolist() for p in summed], "avg": [p.tolist() for p in averaged]}
    errors = {}
    for name, args in {"input": (pieces()[0], pieces()), "count": (None, pieces())}.items():
        count = sum(sizes) + (1 if name == "count" else 0)
        try:
            c.run(OP_ALL_REDUCE, code, REDOP_SUM, args[0], args[1], count, 0, 0)
            errors[name] = None
        except Exception as error:  # noqa: BLE001
            errors[name] = _error(error)
    out["errors"] = errors
    return out


# ---------------------------------------------------------------------------------------------
# 4. Several Python threads on one group

def _run_threads(body, nthreads):
    """Runs body(thread) on nthreads threads started together; returns their results and
    errors."""
    start = threading.Barrier(nthreads)
    results, errors = [None] * nthreads, []

    def main(thread):
        try:
            start.wait()
            results[thread] = body(thread)
        except BaseException as error:  # noqa: BLE001
            errors.append(f"thread {thread}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=main, args=(k,)) for k in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def threads_own_streams(iterations: int, count: int):
    """Thread k issues `iterations` blocking all_reduces on stream k; every element of every
    result must equal the math exactly.  Returns the list of failures."""
    import dptc
    rank, size = dptc.get_rank(), dptc.get_world_size()
    dptc.all_reduce(torch.ones(4))
    index = torch.arange(count, dtype=torch.float64)

    def value(r, k, i):
        return 1000.0 * (r + 1) + 100.0 * k + i + index

    def body(k):
        failures = []
        for i in range(iterations):
            tensor = value(rank, k, i).clone()
            dptc.all_reduce(tensor, stream=k)
            want = sum(value(r, k, i) for r in range(size))
            wrong = int((tensor != want).sum().item())
            if wrong:
                failures.append(f"rank {rank} thread {k} iteration {i}: {wrong} of {count} "
                                f"elements differ")
        return failures

    results, errors = _run_threads(body, 2)
    return errors + [line for failures in results if failures for line in failures]


def threads_one_stream(iterations: int, count: int):
    """Two threads per rank both issue `iterations` identical all_reduces on stream 0, thread t
    of rank r contributing (r + 1) * (t + 1) in every element.  Returns, per thread, the value
    of each result (None when its elements were not all equal) and the errors."""
    import dptc
    rank = dptc.get_rank()
    dptc.all_reduce(torch.ones(4))

    def body(t):
        sums = []
        for _ in range(iterations):
            tensor = torch.full((count,), float((rank + 1) * (t + 1)), dtype=torch.float64)
            dptc.all_reduce(tensor)
            first = tensor[0].item()
            sums.append(first if bool((tensor == first).all()) else None)
        return sums

    results, errors = _run_threads(body, 2)
    return {"sums": results, "errors": errors}


# ---------------------------------------------------------------------------------------------
# 5. A Work dropped without wait()

def dropped_work(late_s: float, count: int):
    """Rank 0 starts all_reduce(T, async_op=True), drops its only reference to T, then drops the
    Work without waiting, while rank 1 issues its all_reduce only `late_s` seconds later.  A
    thread samples a weak reference to T every 10 ms meanwhile.

    Rank 0 returns how long dropping the Work took, whether T was alive at every sample taken
    before the drop returned, and whether it is alive after; rank 1 what its all_reduce gave
    (or raised) and when."""
    import weakref

    import dptc
    rank = dptc.get_rank()
    dptc.all_reduce(torch.ones(4))  # every rank is up and the group is initialised
    tensor = torch.full((count,), float(rank + 1))
    if rank == 1:
        time.sleep(late_s)
        started = time.monotonic()
        try:
            dptc.all_reduce(tensor)
            error = None
        except Exception as caught:  # noqa: BLE001 - reported to the test
            error = _error(caught)
        return {"error": error, "elapsed": time.monotonic() - started,
                "values": sorted(set(tensor.tolist()))}
    work = dptc.all_reduce(tensor, async_op=True)
    alive = weakref.ref(tensor)
    del tensor
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), alive() is not None))
            time.sleep(0.01)
    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    del work
    returned = time.monotonic()
    stop.set()
    sampler.join()
    # The last 50 ms are left out: the Work releases T just before the drop returns.
    during = [is_alive for at, is_alive in samples if at < returned - 0.05]
    return {"drop_elapsed": returned - started, "samples_during": len(during),
            "alive_during": all(during), "alive_after": alive() is not None}


# ---------------------------------------------------------------------------------------------
# 6. The reducer's step end after an interrupted backward

class _BoomNet(torch.nn.Module):
    """Two layers; with `boom` set, the backward raises between them."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
        self.boom = False

    def forward(self, x):
        hidden = self.first(x)
        return self.second(_Boom.apply(hidden) if self.boom else hidden)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward interrupted on purpose")


def interrupted_step_end(late_s: float):
    """DDP over two layers, each its own bucket.  Rank 0's backward raises between them: the
    second layer's gradient is already being all-reduced in place (its bucket launched), and
    rank 1 issues its backward only `late_s` seconds later.  Rank 0 drops its own reference to
    that gradient; the reducer must keep it until the all-reduce is over.  Its next forward
    ends the interrupted step (aborting the group first, so the all-reduce stops at once) and
    only then lets the gradient go.  Rank 0 then fills fresh memory and, once rank 1 is
    through, reports whether anything wrote into it."""
    import weakref

    import dptc
    rank = dptc.get_rank()
    torch.manual_seed(0)
    model = _BoomNet()
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=0.2)
    x = torch.randn(8, 256)
    # One synced step first: the first backward has one bucket (torch's, before the order of
    # the gradients is known), the next ones a bucket per layer.
    ddp(x).sum().backward()
    model.zero_grad(set_to_none=True)
    if rank == 1:
        time.sleep(late_s)
        started = time.monotonic()
        try:
            ddp(x).sum().backward()
            error = None
        except Exception as caught:  # noqa: BLE001 - reported to the test
            error = _error(caught)
        return {"error": error, "elapsed": time.monotonic() - started,
                "buckets": len(ddp._buckets)}
    model.boom = True
    try:
        ddp(x).sum().backward()
        backward_error = None
    except Exception as caught:  # noqa: BLE001
        backward_error = _error(caught)
    grad = weakref.ref(model.second.weight.grad)
    model.zero_grad(set_to_none=True)
    held_by_reducer = grad() is not None
    started = time.monotonic()
    try:
        ddp(x)
        forward_error = None
    except Exception as caught:  # noqa: BLE001
        forward_error = _error(caught)
    forward_s = time.monotonic() - started
    released_after = grad() is None
    junk = [torch.full((256 * 256,), 7.0) for _ in range(32)]
    time.sleep(late_s + 1.0)
    return {"backward_error": backward_error, "held_by_reducer": held_by_reducer,
            "forward_error": forward_error, "forward_s": forward_s,
            "released_after": released_after, "buckets": len(ddp._buckets),
            "junk_intact": all(bool((j == 7.0).all()) for j in junk)}
