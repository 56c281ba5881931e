"""DDP communication hooks that dptc runs natively.

``DistributedDataParallel.register_comm_hook(state, hook)`` recognises these three functions by
identity, and torch's own ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` functions
of the same names, and runs them inside the C reducer: no Python runs per bucket.

- ``allreduce_hook``: the default; each bucket is averaged over the group.
- ``fp16_compress_hook`` / ``bf16_compress_hook``: each float32/float64 bucket is cast to 16 bits
  into a second buffer, all-reduced (the engine accumulates 16-bit values in float32 and divides
  by the group size before rounding once), and cast back.  Buckets already in 16 bits are
  reduced as they are.

Any other hook runs in Python, as under torch: ``hook(state, bucket)`` is called once a
bucket's gradients are in it, with a ``GradBucket`` (torch's interface: ``index()``,
``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``) whose buffer
holds the bucket's gradients, not divided by the world size; it returns a
``torch.futures.Future`` whose value, one tensor of the bucket's size, becomes the gradients.
torch's PowerSGD, quantization, post-local-SGD and debugging hooks run this way.  The hook's
own communication goes where it sends it (``torch.distributed`` calls go through gloo;
``dptc.all_reduce(..., async_op=True).get_future()`` through dptc's engine); dptc
waits for each future at the end of backward within the group's timeout, and raises as soon as
the group fails (see [Note: Python comm hooks] in csrc/reducer.c).

Called directly, outside DDP, the functions behave like torch's: they take an object with a
``buffer()`` method (a ``GradBucket``) and return a completed ``torch.futures.Future`` holding
the reduced buffer.
"""

import inspect
import threading
import time

import torch

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "GradBucket"]

# Codes shared with csrc/reducer.c (comm_mode).
COMM_PLAIN = 0
COMM_FP16 = 1
COMM_BF16 = 2
COMM_PYTHON = 3

# Seconds between looks at the group's failure while a hook's future is pending.
_FAILURE_POLL_S = 0.02


def _reduce_buffer(process_group, bucket, dtype):
    from .collectives import ReduceOp, all_reduce
    buffer = bucket.buffer()
    work = buffer if dtype is None or buffer.dtype == dtype else buffer.to(dtype)
    all_reduce(work, op=ReduceOp.AVG, group=process_group)
    if work is not buffer:
        buffer.copy_(work)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def allreduce_hook(process_group, bucket):
    """Averages the bucket over process_group (None: the default group)."""
    return _reduce_buffer(process_group, bucket, None)


def fp16_compress_hook(process_group, bucket):
    """Averages the bucket over process_group with float16 on the wire."""
    return _reduce_buffer(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group, bucket):
    """Averages the bucket over process_group with bfloat16 on the wire."""
    return _reduce_buffer(process_group, bucket, torch.bfloat16)


def native_mode(hook):
    """The reducer's comm mode for a hook dptc runs natively, or None."""
    modes = {allreduce_hook: COMM_PLAIN, fp16_compress_hook: COMM_FP16,
             bf16_compress_hook: COMM_BF16}
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:  # a torch built without distributed
        default_hooks = None
    if default_hooks is not None:
        modes[default_hooks.allreduce_hook] = COMM_PLAIN
        modes[default_hooks.fp16_compress_hook] = COMM_FP16
        modes[default_hooks.bf16_compress_hook] = COMM_BF16
    try:
        return modes.get(hook)
    except TypeError:  # unhashable callable
        return None


def builtin_mode(comm_hook_type):
    """The reducer's comm mode for a torch.distributed.BuiltinCommHookType."""
    import torch.distributed as dist
    modes = {dist.BuiltinCommHookType.ALLREDUCE: COMM_PLAIN,
             dist.BuiltinCommHookType.FP16_COMPRESS: COMM_FP16}
    if comm_hook_type not in modes:
        raise ValueError(f"comm_hook_type must be a torch.distributed.BuiltinCommHookType "
                         f"(ALLREDUCE or FP16_COMPRESS), got {comm_hook_type!r}")
    return modes[comm_hook_type]


def hook_name(hook):
    return getattr(hook, "__qualname__", None) or repr(hook)


def check_hook(hook):
    """torch's checks of a hook's annotations: a bucket annotated as something other than a
    GradBucket, or a return annotated as something other than Future[Tensor], is refused."""
    if not callable(hook):
        raise TypeError(f"hook must be callable, got {type(hook).__name__}")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    import torch.distributed as dist
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty,
                                                        dist.GradBucket, GradBucket):
        raise ValueError(f"communication hook {hook_name(hook)}: its bucket parameter is "
                         f"annotated {bucket.annotation!r}; annotate it dist.GradBucket or "
                         f"leave it unannotated")
    if signature.return_annotation not in (inspect.Signature.empty,
                                           torch.futures.Future[torch.Tensor]):
        raise ValueError(f"communication hook {hook_name(hook)}: its return is annotated "
                         f"{signature.return_annotation!r}; a hook returns "
                         f"torch.futures.Future[torch.Tensor]")


class GradBucket:
    """One gradient bucket as a Python communication hook sees it, with the methods of torch's
    ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat bucket: the gradients of ``parameters()``, packed in that order,
    summed over this rank's backward only (the hook divides, as under torch).
    ``gradients()`` are views of the current buffer shaped like the parameters;
    ``set_buffer(tensor)`` replaces the buffer those methods return (torch's compression
    wrappers put a 16-bit copy there).
    """

    def __init__(self, index, count, buffer, parameters):
        self._index = index
        self._count = count
        self._buffer = buffer
        self._parameters = tuple(parameters)

    def index(self):
        """The bucket's position in launch order: 0 holds the gradients ready first."""
        return self._index

    def is_last(self):
        """Whether this is the last bucket of the step (the one launched last)."""
        return self._index == self._count - 1

    def buffer(self):
        return self._buffer

    def set_buffer(self, buffer):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"set_buffer takes a torch.Tensor, got {type(buffer).__name__}")
        if buffer.numel() != self._buffer.numel():
            raise ValueError(f"set_buffer: the bucket holds {self._buffer.numel()} elements, "
                             f"the new buffer {buffer.numel()}; pass a tensor of the same "
                             f"number of elements")
        self._buffer = buffer

    def parameters(self):
        return list(self._parameters)

    def gradients(self):
        views, offset = [], 0
        flat = self._buffer.view(-1)
        for param in self._parameters:
            views.append(flat[offset:offset + param.numel()].view(param.shape))
            offset += param.numel()
        return views

    def __repr__(self):
        return (f"<dptc GradBucket {self._index} of {self._count}: "
                f"{len(self._parameters)} parameters, {self._buffer.numel()} elements>")


class LaunchedBucket:
    """A bucket whose hook returned `future`; `finish()` (called by the reducer at the end of
    backward) waits for it and writes its value into the bucket tensor."""

    def __init__(self, future, tensor, hook, index, group):
        self._future = future
        self._tensor = tensor
        self._hook = hook
        self._index = index
        self._group = group

    def _what(self):
        return f"the communication hook {hook_name(self._hook)} on bucket {self._index}"

    def finish(self):
        result = _wait_future(self._future, self._group, self._what())
        if not isinstance(result, torch.Tensor):
            remedy = ("end the chain with .then(lambda fut: fut.value()[0]), as torch's "
                      "default hooks do" if isinstance(result, (list, tuple)) else
                      "set one tensor of the bucket's size as its result")
            raise TypeError(f"{self._what()}: its future's value must be a tensor, got "
                            f"{type(result).__name__}; {remedy}")
        if result.numel() != self._tensor.numel():
            raise ValueError(f"{self._what()}: its future's tensor has {result.numel()} "
                             f"elements, the bucket {self._tensor.numel()}; return a tensor of "
                             f"the bucket's size")
        same = (result.dtype == self._tensor.dtype and result.device == self._tensor.device
                and result.data_ptr() == self._tensor.data_ptr() and result.is_contiguous())
        if not same:
            with torch.no_grad():
                self._tensor.copy_(result.reshape(-1))


def _wait_future(future, group, what):
    """future's value, waiting within the group's timeout; raises PeerLostError as soon as the
    group has failed (a peer aborted), or when the future failed after it, DistTimeoutError
    (after aborting the group) when the deadline passes, or else the future's own error."""
    if not future.done():
        from . import DistTimeoutError, PeerLostError
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        deadline = time.monotonic() + group.timeout
        while not done.wait(_FAILURE_POLL_S):
            failure = group._c.failure()
            if failure is not None:
                raise PeerLostError(f"{what} was waiting when the process group failed: "
                                    f"{failure}")
            if time.monotonic() >= deadline:
                reason = (f"DistributedDataParallel: {what} did not complete within the "
                          f"group's timeout of {group.timeout:g} s")
                group._c.abort(reason)
                raise DistTimeoutError(f"{reason}; every rank must run the hook's "
                                       f"communication for every bucket (DPTC_TIMEOUT or "
                                       f"init_process_group(timeout=) sets the timeout)")
    try:
        return future.wait()
    except Exception as error:
        failure = group._c.failure()
        if failure is None:
            raise
        from . import PeerLostError  # its peer's abort is what made the hook's work fail
        raise PeerLostError(f"{what} failed after the process group failed: {failure} "
                            f"(the hook's error: {error})") from error
