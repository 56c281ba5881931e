"""Collectives with torch.distributed's signatures, run by dptc's C engine.

Each function checks its arguments, then hands C the tensors' data pointers,
element counts and dtype codes; the bytes move in C with the GIL released.
With ``async_op=True`` the function returns a handle (``wait()``,
``is_completed()``) that keeps the tensors alive until the work completes.
"""

import torch
import torch.distributed as dist

from ._dtypes import (OP_ALL_GATHER, OP_ALL_REDUCE, OP_BARRIER, OP_BROADCAST,
                      OP_REDUCE_SCATTER, dtype_code, redop_code)
from .group import resolve

__all__ = ["ReduceOp", "all_reduce", "broadcast", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "barrier"]

ReduceOp = dist.ReduceOp


def _check_tensor(tensor, argname):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{argname} is on device {tensor.device}, but dptc's engine moves CPU "
                         f"tensors; move it with .cpu() (the GPU transport comes with NCCL)")
    if tensor.layout != torch.strided:
        raise ValueError(f"{argname} has layout {tensor.layout}; dptc communicates dense "
                         f"tensors: use .to_dense()")
    if not tensor.is_contiguous():
        raise ValueError(f"{argname} is not contiguous (shape {tuple(tensor.shape)}, stride "
                         f"{tensor.stride()}); pass tensor.contiguous() and copy back")
    return dtype_code(tensor.dtype, argname)


def _check_pair(pg, shard, shard_name, full, full_name):
    """Checks a (shard, world_size * shard) pair of same-dtype tensors; returns the dtype code."""
    code = _check_tensor(shard, shard_name)
    _check_tensor(full, full_name)
    if full.dtype != shard.dtype:
        raise TypeError(f"{full_name} has dtype {full.dtype} but {shard_name} has {shard.dtype}; "
                        f"they must match")
    if full.numel() != pg.size * shard.numel():
        raise ValueError(f"{full_name} must have world_size * {shard_name}.numel() = {pg.size} "
                         f"* {shard.numel()} elements, got {full.numel()}")
    return code


def _issue(pg, op, dtype, redop, input, output, count, root, keep, async_op):
    args = (op, dtype, redop, input.data_ptr() if input is not None else 0,
            output.data_ptr() if output is not None else 0, count, root)
    if async_op:
        return pg._c.submit(*args, keep)
    pg._c.run(*args)
    return None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces tensor in place across the group (SUM, AVG, MAX, MIN, PRODUCT)."""
    pg = resolve(group)
    code = _check_tensor(tensor, "tensor")
    redop = redop_code(op, tensor.dtype)
    return _issue(pg, OP_ALL_REDUCE, code, redop, tensor, tensor, tensor.numel(), 0,
                  (tensor,), async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """Copies rank src's tensor into tensor on every rank."""
    pg = resolve(group)
    code = _check_tensor(tensor, "tensor")
    if not isinstance(src, int) or not 0 <= src < pg.size:
        raise ValueError(f"src must be a rank in [0, {pg.size}), got {src!r}")
    return _issue(pg, OP_BROADCAST, code, 0, tensor, tensor, tensor.numel(), src, (tensor,),
                  async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenates every rank's input_tensor, by rank, into output_tensor."""
    pg = resolve(group)
    code = _check_pair(pg, input_tensor, "input_tensor", output_tensor, "output_tensor")
    return _issue(pg, OP_ALL_GATHER, code, 0, input_tensor, output_tensor, input_tensor.numel(),
                  0, (output_tensor, input_tensor), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduces input across ranks and leaves block `rank` of the result in output."""
    pg = resolve(group)
    code = _check_pair(pg, output, "output", input, "input")
    redop = redop_code(op, input.dtype)
    return _issue(pg, OP_REDUCE_SCATTER, code, redop, input, output, output.numel(), 0,
                  (output, input), async_op)


# torch 2.13's names for the same two collectives.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def barrier(group=None, async_op=False, device_ids=None):
    """Returns once every rank of the group has entered the barrier."""
    pg = resolve(group)
    return _issue(pg, OP_BARRIER, 0, 0, None, None, 0, 0, None, async_op)
