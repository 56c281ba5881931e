"""DDP communication hooks that dptc runs natively.

``DistributedDataParallel.register_comm_hook(state, hook)`` recognises these three functions by
identity, and torch's own ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` functions
of the same names, and runs them inside the C reducer: no Python runs per bucket.

- ``allreduce_hook``: the default; each bucket is averaged over the group.
- ``fp16_compress_hook`` / ``bf16_compress_hook``: each float32/float64 bucket is cast to 16 bits
  into a second buffer, all-reduced (the engine accumulates 16-bit values in float32 and divides
  by the group size before rounding once), and cast back.  Buckets already in 16 bits are
  reduced as they are.

Any other hook is refused with NotImplementedError: dptc does not run arbitrary Python hooks
(GradBucket and futures) yet.

Called directly, outside DDP, the functions behave like torch's: they take an object with a
``buffer()`` method (a ``GradBucket``) and return a completed ``torch.futures.Future`` holding
the reduced buffer.
"""

import torch

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]

# Codes shared with csrc/reducer.c (comm_mode).
COMM_PLAIN = 0
COMM_FP16 = 1
COMM_BF16 = 2


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
