"""Rank-side bodies of tests/test_work_future.py: Work.result() and Work.get_future().

Every function takes `impl` ("torch": torch.distributed on gloo, the reference; "dptc") and
runs the same body on both, through tests._rank.load_impl.  Tensors are described as
[shape, dtype, values, offset] lists (offset: bytes from the start of the collective's output
tensor when the value's storage is the output's, else None), so the test compares structure
and numbers across implementations.
"""

import os
import signal
import threading
import time

import torch
import torch.nn.functional as F

from tests._rank import load_impl, start_clock

# Seconds a future may take to complete by itself before the case reports it never did.
COMPLETION_LIMIT_S = 20.0


def _describe(tensor, base):
    offset = None
    if base is not None and tensor.untyped_storage().data_ptr() == \
            base.untyped_storage().data_ptr():
        offset = tensor.data_ptr() - base.data_ptr()
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    return [list(tensor.shape), str(tensor.dtype), values.double().flatten().tolist(), offset]


def _describe_value(value, base):
    if isinstance(value, torch.Tensor):
        return {"type": "tensor", "tensor": _describe(value, base)}
    if not isinstance(value, (list, tuple)):
        return {"type": type(value).__name__}
    return {"type": type(value).__name__,
            "items": [_describe(t, base) if isinstance(t, torch.Tensor) else type(t).__name__
                      for t in value]}


def _error(exc):
    return {"error_type": type(exc).__name__, "error": str(exc)[:300]}


def _cases(api, rank, size):
    """(name, issue) pairs; issue() returns (work, base tensor whose storage the value may
    share, the tensor the value's first item should be)."""
    fill = float(rank + 1)

    def all_reduce():
        t = torch.full((5,), fill)
        return api.all_reduce(t, async_op=True), t, t

    def all_reduce_complex():
        t = torch.full((3,), complex(fill, -fill), dtype=torch.complex64)
        return api.all_reduce(t, async_op=True), t, None

    def broadcast():
        t = torch.full((2, 3), fill)
        return api.broadcast(t, src=size - 1, async_op=True), t, t

    def all_gather_into_tensor():
        out = torch.zeros(size * 4)
        return api.all_gather_into_tensor(out, torch.arange(4.0) + 10 * rank,
                                          async_op=True), out, None

    def all_gather_into_tensor_2d():
        out = torch.zeros(size * 2, 3)
        return api.all_gather_into_tensor(out, torch.full((2, 3), fill),
                                          async_op=True), out, None

    def reduce_scatter_tensor():
        out = torch.zeros(3)
        return api.reduce_scatter_tensor(out, torch.arange(3.0 * size) * fill,
                                         async_op=True), out, out

    def barrier():
        return api.barrier(async_op=True), None, None

    return [("all_reduce", all_reduce), ("all_reduce_complex", all_reduce_complex),
            ("broadcast", broadcast), ("all_gather_into_tensor", all_gather_into_tensor),
            ("all_gather_into_tensor_2d", all_gather_into_tensor_2d),
            ("reduce_scatter_tensor", reduce_scatter_tensor), ("barrier", barrier)]


def _await_without_wait(future):
    """Polls future.done() (never waiting on the work or the future): whether it completed by
    itself within COMPLETION_LIMIT_S."""
    deadline = time.monotonic() + COMPLETION_LIMIT_S
    while not future.done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def values(impl):
    """Per collective: the future's value and result(), with the callbacks' counts.

    Returns {case: {"future": ..., "result": ..., "done_by_itself": bool, "then_calls": n,
    "done_calls": n, "same_object": bool, "same_future_object": bool,
    "same_future_value": bool}} where "future" and "result"
    are _describe_value's dicts or {"error_type", "error"} when the call raised."""
    api = load_impl(impl)
    rank, size = api.get_rank(), api.get_world_size()
    out = {}
    for name, issue in _cases(api, rank, size):
        work, base, first = issue()
        record = {}
        try:
            future = work.get_future()
        except Exception as exc:  # noqa: BLE001 - torch's gloo lacks some; recorded
            record["future"] = _error(exc)
            work.wait()
        else:
            calls = {"then": 0, "done": 0}

            def then(fut):
                calls["then"] += 1
                return fut.value()

            def done(fut):
                calls["done"] += 1

            chained = future.then(then)
            future.add_done_callback(done)
            record["done_by_itself"] = _await_without_wait(future)
            value = future.wait()
            chained.wait()
            record["future"] = _describe_value(value, base)
            record["same_object"] = bool(first is not None and value and value[0] is first)
            # torch wraps its one future anew on every call (dptc returns the same object):
            # either way a second call gives the same tensors.
            again = work.get_future()
            record["same_future_object"] = again is future
            record["same_future_value"] = [t.data_ptr() for t in again.value()] == \
                [t.data_ptr() for t in value]
            time.sleep(0.05)   # a second run of a callback would land here
            record["then_calls"], record["done_calls"] = calls["then"], calls["done"]
            work.wait()
        try:
            record["result"] = _describe_value(work.result(), base)
        except Exception as exc:  # noqa: BLE001
            record["result"] = _error(exc)
        out[name] = record
    if api.name == "dptc":
        out["all_gather_into_tensors"] = _several_outputs(api, rank, size)
    out["result_early"] = _result_early(api, rank)
    out["late_future"] = _late_future(api, rank)
    api.barrier()
    return out


def _several_outputs(api, rank, size):
    """dptc's all_gather_into_tensors: the future holds its outputs, the objects passed."""
    first, second = torch.zeros(size * 2), torch.zeros(size * 3)
    work = api.module.all_gather_into_tensors([first, second], torch.arange(5.0) + 10 * rank,
                                              async_op=True)
    value = work.get_future().wait()
    return {"future": [_describe(t, None) for t in value],
            "same_objects": len(value) == 2 and value[0] is first and value[1] is second,
            "result_same": [t.data_ptr() for t in work.result()] ==
                           [t.data_ptr() for t in value]}


def _result_early(api, rank):
    """result() while the collective waits for rank 1 (0.5 s late): RuntimeError, as torch's."""
    t = torch.ones(4)
    if rank == 1:
        time.sleep(0.5)
    work = api.all_reduce(t, async_op=True)
    try:
        early = _describe_value(work.result(), t) if rank == 0 else None
    except Exception as exc:  # noqa: BLE001
        early = _error(exc)
    work.wait()
    return early


def _late_future(api, rank):
    """get_future() after wait(): completed at once, its callbacks run once, in the caller."""
    t = torch.full((2,), float(rank))
    work = api.all_reduce(t, async_op=True)
    work.wait()
    future = work.get_future()
    calls = []
    chained = future.then(lambda fut: calls.append(threading.current_thread().name)
                          or fut.value()[0] + 1)
    return {"done": future.done(), "chained": chained.wait().tolist(),
            "calls_in_caller": calls == [threading.current_thread().name]}


# ---------------------------------------------------------------------------------------------
# DDP with a comm hook in torch's documented get_future().then() form

STEPS = 4
ROWS = 4
CTX = 8
VOCAB = 32


def train_with_hook(impl):
    """A small GPT trained for STEPS SGD steps under `impl`'s DDP whose comm hook averages each
    bucket with `impl`'s own all_reduce, as torch's default hook and its tutorial write it.
    Returns {"params": {name: flat list}, "hook_calls": n, "then_calls": n}."""
    from examples.gpt import build_gpt
    api = load_impl(impl)
    if impl == "dptc":
        import dptc
        wrapper = dptc.DistributedDataParallel
    else:
        wrapper = torch.nn.parallel.DistributedDataParallel
    rank, size = api.get_rank(), api.get_world_size()
    torch.manual_seed(0)
    model = build_gpt(vocab=VOCAB, d_model=16, n_layer=2, n_head=2, ctx=CTX)
    ddp = wrapper(model, bucket_cap_mb=0.01)   # several buckets, so several hooks in flight
    counts = {"hook": 0, "then": 0}

    def allreduce_then(process_group, bucket):
        counts["hook"] += 1
        tensor = bucket.buffer().div_(size)

        def unpack(fut):
            counts["then"] += 1
            return fut.value()[0]

        return api.all_reduce(tensor, group=process_group, async_op=True) \
            .get_future().then(unpack)

    ddp.register_comm_hook(None, allreduce_then)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        tokens = torch.randint(0, VOCAB, (ROWS, CTX + 1), generator=generator)
        logits = ddp(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    api.barrier()
    return {"params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "hook_calls": counts["hook"], "then_calls": counts["then"]}


# ---------------------------------------------------------------------------------------------
# Failures, exit and fork (dptc)

def peer_dies(impl, victim, when):
    """`victim` dies by SIGKILL while the others' futures are pending; they wait on the future
    only (never on the work), which must raise the collective's error.

    when="before": the victim dies before issuing the collective; "during": every rank loops
    over 1 MiB async all_reduces, each through its future, and the victim dies 0.5 s in.
    The clock starts right before the wait that should fail."""
    api = load_impl(impl)
    rank = api.get_rank()
    api.all_reduce(torch.ones(16))
    if when == "before":
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        future = api.all_reduce(torch.ones(1000), async_op=True).get_future()
        start_clock()
        future.wait()
    elif when == "during":
        tensor = torch.ones(1 << 18)
        if rank == victim:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start_clock()
        for _ in range(1_000_000):
            future = api.all_reduce(tensor, op=api.ReduceOp.MAX, async_op=True).get_future()
            future.then(lambda fut: fut.value()[0])
            future.wait()
    else:
        raise ValueError(f"when must be 'before' or 'during', got {when!r}")
    return "completed"


def chained_error(impl):
    """The error as a `.then()` chain sees it: the callback's fut.value() raises the
    collective's exception (type name recorded); the chain's own future then raises torch's
    RuntimeError naming it.  Rank 1 leaves at once (its exit fails rank 0's collective)."""
    api = load_impl(impl)
    rank = api.get_rank()
    api.all_reduce(torch.ones(4))
    if rank == 1:
        return {}
    seen = []

    def callback(fut):
        try:
            return fut.value()
        except Exception as exc:
            seen.append(type(exc).__name__)
            raise

    future = api.all_reduce(torch.ones(4), async_op=True).get_future()
    chained = future.then(callback)
    out = {}
    for key, fut in (("future", future), ("chained", chained)):
        try:
            fut.wait()
            out[key] = None
        except Exception as exc:  # noqa: BLE001
            out[key] = _error(exc)
    out["callback_saw"] = seen
    return out


def pending_at_exit(impl):
    """Rank 0 returns (and its process exits) with a future pending, a daemon thread blocked in
    its wait() and a `.then()` callback attached; rank 1 never issues the collective and leaves
    a moment later.  Both processes must exit with status 0 (the harness checks)."""
    api = load_impl(impl)
    rank = api.get_rank()
    api.all_reduce(torch.ones(4))
    if rank == 0:
        future = api.all_reduce(torch.ones(4), async_op=True).get_future()
        future.then(lambda fut: fut.value())
        threading.Thread(target=future.wait, daemon=True).start()
        time.sleep(0.2)
        return {"pending": not future.done()}
    time.sleep(1.0)
    return {}


def forked_child(impl):
    """Rank 0 forks while its async all_reduce waits for rank 1 (0.5 s late) and after it
    asked for the future; the child asks for the future of the parent's work (RuntimeError)
    and leaves.  The parent's future then completes with the sum, and one more all_reduce
    works.  Returns rank 0's findings."""
    api = load_impl(impl)
    rank = api.get_rank()
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(0.5)
        api.all_reduce(t)
        api.all_reduce(torch.ones(2))
        return {}
    work = api.all_reduce(t, async_op=True)
    future = work.get_future()
    pending = not future.done()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                work.get_future()
                message = "no error"
            except RuntimeError as exc:
                message = f"RuntimeError: {exc}"
            os.write(write, message.encode()[:500])
        finally:
            os._exit(0)
    os.close(write)
    child_said = os.read(read, 600).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    after = torch.ones(2)
    value = future.wait()[0].tolist()
    api.all_reduce(after)
    return {"pending_at_fork": pending, "child_said": child_said,
            "child_exit": os.waitstatus_to_exitcode(status), "value": value,
            "after": after.tolist()}
