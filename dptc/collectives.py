"""Collectives with torch.distributed's signatures, run by dptc's C engine.

Each function checks its arguments, then hands C the tensors themselves with their element
counts and dtype codes; C asks each tensor for its data pointer and the bytes move in C with the
GIL released.  ``group`` is anything torch accepts (see group.resolve); on a rank outside the
group a collective does nothing and returns None, as torch's do.
With ``async_op=True`` the function returns a handle (``wait()``, ``is_completed()``,
``result()``, ``get_future()``) that keeps the tensors alive until the work completes;
``result()`` and the future's value are torch's gloo lists (see [Note: futures of works] in
_futures.py), and the future completes when the collective does, with nobody waiting.  CUDA
tensors go through the group's NCCL engine, ordered after the work of the current CUDA stream;
there, ``wait()`` and a blocking call make the current stream wait, not the host, and
``result()`` and ``get_future()`` are torch's NCCL Work's (CudaWork).
While a torch profiler records, each call runs inside a named range (see [Note: profiler
ranges] in _ranges.py).
"""

import operator

import torch
import torch.distributed as dist

from . import _cuda
from . import _futures
from . import _ranges
from ._dtypes import (BITWISE_REDOPS, OP_ALL_GATHER, OP_ALL_REDUCE, OP_BARRIER, OP_BROADCAST,
                      OP_REDUCE_SCATTER, dtype_code, redop_code, redop_name)
from ._C import DistError
from .group import resolve

__all__ = ["ReduceOp", "all_reduce", "broadcast", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "barrier",
           "all_gather_into_tensors"]

ReduceOp = dist.ReduceOp


def _check_tensor(tensor, argname):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        # The first CUDA tensor loads NCCL and the CUDA runtime (dptc.CudaLibraryError names
        # what is missing); see [Note: loading NCCL and the CUDA runtime] in csrc/cudalib.h.
        _cuda.load()
    elif tensor.is_meta:
        raise ValueError(f"{argname} is a meta tensor (shape {tuple(tensor.shape)}, "
                         f"{tensor.dtype}), which holds no data to communicate; materialize "
                         f"it first: module.to_empty(device='cpu') for a module built on the "
                         f"meta device (then initialise its parameters), or "
                         f"torch.empty_like({argname}, device='cpu') for a tensor")
    elif tensor.device.type != "cpu":
        raise ValueError(f"{argname} is on device {tensor.device}, but dptc moves CPU tensors "
                         f"(shared memory, gloo) and CUDA tensors (NCCL); move it with .cpu()")
    if tensor.layout != torch.strided:
        raise ValueError(f"{argname} has layout {tensor.layout}; dptc communicates dense "
                         f"tensors: use .to_dense()")
    if not tensor.is_contiguous():
        raise ValueError(f"{argname} is not contiguous (shape {tuple(tensor.shape)}, stride "
                         f"{tensor.stride()}); pass tensor.contiguous() and copy back")
    return dtype_code(tensor.dtype, argname)


# [Note: non-contiguous tensors]
# torch's gloo takes strided tensors (a transposed matrix, every other element of a vector) in
# all four collectives.  dptc's engine moves contiguous bytes, so the public collectives run on
# a contiguous copy: an input is copied before the call; a tensor the collective writes
# (all_reduce's and broadcast's tensor, the gathered or reduced output) is copied from (when the
# collective also reads it) and written back into once the collective completes: at once for
# a blocking call, at wait() or result() or when its future completes for async_op=True
# (_WrittenBack).  A tensor whose elements share memory (an expanded one, stride 0) cannot be
# written: RuntimeError in torch's words, naming .clone(), where torch's gloo writes one element
# several times or past the end of its storage.  all_gather_into_tensors, for FSDP's storage,
# takes contiguous tensors only.

def _staged(tensor, argname, *, read, written):
    """(the tensor the collective runs on, the caller's tensor to write it back into or
    None); see [Note: non-contiguous tensors].  Anything else than a non-contiguous strided
    tensor comes back as it is, for _check_tensor to judge."""
    try:
        if tensor.is_contiguous():   # the hot path: one call
            return tensor, None
    except (AttributeError, RuntimeError):   # not a tensor, or a sparse one
        return tensor, None
    if tensor.layout != torch.strided or tensor.is_meta:
        return tensor, None
    if written and torch._debug_has_internal_overlap(tensor) == 1:
        # RuntimeError and torch's words first, as torch's raises it for an output.
        raise RuntimeError(f"unsupported operation: more than one element of the written-to "
                           f"tensor refers to a single memory location: {argname} (shape "
                           f"{tuple(tensor.shape)}, stride {tensor.stride()}) is expanded, so "
                           f"the collective cannot write its result into it; pass "
                           f"{argname}.clone() (a tensor of its own memory) instead")
    if read:
        staged = tensor.contiguous()
    else:
        staged = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return staged, (tensor if written else None)


def _written_back(work, target, staged):
    """The collective's return value, once the staged copy is (or will be) written back into
    target (see [Note: non-contiguous tensors]); work itself where nothing was staged (target
    None)."""
    if target is None:
        return work
    if work is None:
        target.copy_(staged)
        return None
    return _WrittenBack(work, target, staged)


class _WrittenBack:
    """The handle of an async collective on a non-contiguous tensor: the collective ran on a
    contiguous copy, written back into the caller's tensor by wait(), result(), an
    is_completed() that returns True, or when its future completes; otherwise the underlying
    handle's (see [Note: non-contiguous tensors])."""

    __slots__ = ("_work", "_target", "_staged", "_written")

    def __init__(self, work, target, staged):
        self._work, self._target, self._staged, self._written = work, target, staged, False

    def _write_back(self):
        if not self._written:
            self._target.copy_(self._staged)
            self._written = True

    def _values(self, values):
        """The work's values with the caller's tensor in place of the staged copy."""
        self._write_back()
        if len(values) == 1 and values[0] is self._staged:
            return [self._target]
        if values and all(value._base is self._staged for value in values):
            try:   # an all-gather's per-rank pieces, as views of the caller's output
                return list(self._target.view((len(values),) + tuple(values[0].shape))
                            .unbind(0))
            except RuntimeError:
                return values
        return values

    def wait(self, timeout=None):
        done = self._work.wait(timeout=timeout)
        self._write_back()
        return done

    def is_completed(self):
        # A caller that polls instead of waiting reads its tensor once this says True.
        done = self._work.is_completed()
        if done:
            self._write_back()
        return done

    def result(self):
        if self._target.is_cuda:
            # CUDA's result() does not wait: order the write-back after the collective.
            self._work.wait()
        return self._values(self._work.result())

    def get_future(self):
        return self._work.get_future().then(lambda future: self._values(future.value()))

    def __getattr__(self, name):
        return getattr(self._work, name)


def _as_real(tensor, argname, op=None, what=None):
    """A complex tensor as its (real, imaginary) pairs, as torch.distributed communicates it
    (a view: the collective writes into the tensor itself); other tensors unchanged.  A
    reduction other than SUM or AVG is refused, as torch refuses it."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_complex():
        return tensor
    if op is not None and not any(op == allowed for allowed in (ReduceOp.SUM, ReduceOp.AVG)):
        raise ValueError(f"{what} does not support op={op!r} on complex tensors ({argname} "
                         f"has dtype {tensor.dtype}), as torch's does not; use ReduceOp.SUM or "
                         f"ReduceOp.AVG, or reduce the real and imaginary parts apart")
    if not tensor.is_contiguous():
        return tensor   # _check_tensor names the problem
    if tensor.is_conj():
        # RuntimeError, as torch's (its view_as_real raises it).
        raise RuntimeError(f"{argname} is a conjugate view (tensor.conj()), which a collective "
                         f"cannot write through; pass {argname}.resolve_conj() and copy back")
    return torch.view_as_real(tensor)


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


def _issue(pg, op, dtype, redop, input, output, count, root, async_op, stream):
    if async_op.__class__ is not bool and async_op not in (True, False):
        # torch raises TypeError too; a truthy string would return a handle nobody waits for.
        raise TypeError(f"async_op must be a bool, got {async_op!r}")
    if not isinstance(stream, int) or not 0 <= stream < pg.num_streams:
        raise ValueError(f"stream must be an int in [0, {pg.num_streams}) (the group's "
                         f"num_streams; DPTC_STREAMS sets it), got {stream!r}")
    args = (op, dtype, redop, input, output, count, root, stream)
    # One attribute read decides the transport on the CPU's hot path.
    cuda = (input is not None and input.is_cuda) or (output is not input and _any_cuda(output))
    issue = _issue_cuda if cuda else _issue_cpu
    if _profiler_flags._is_profiler_enabled:
        return _issue_in_range(issue, pg, args, async_op)
    return issue(pg, args, async_op)


def _issue_cpu(pg, args, async_op):
    if async_op:
        return pg._c.submit(*args)
    pg._c.run(*args)
    return None


# See [Note: profiler ranges] in _ranges.py: reading this flag is all a collective pays when no
# profiler records.
_profiler_flags = _ranges.flags


def _issue_in_range(issue, pg, args, async_op):
    """_issue while a profiler records: the collective inside its named range (a blocking call
    on CPU tensors to its completion; an async one, or one on CUDA tensors, its launch)."""
    with _ranges.Range(_ranges.COLLECTIVE_NAMES[args[0]]):
        return issue(pg, args, async_op)


# ---------------------------------------------------------------------------------------------
# CUDA tensors: the group's NCCL engine (see [Note: the NCCL transport] in csrc/nccl.h)

def _any_cuda(output):
    if isinstance(output, torch.Tensor):
        return output.is_cuda
    return isinstance(output, (list, tuple)) and any(t.is_cuda for t in output)


def _cuda_device(input, output):
    """The one CUDA device of a collective's tensors; ValueError when they are not all on it."""
    outputs = list(output) if isinstance(output, (list, tuple)) else [output]
    devices = {t.device for t in [input, *outputs] if t is not None}
    if len(devices) != 1:
        raise ValueError(f"a collective's tensors must all be on one CUDA device, got "
                         f"{sorted(str(d) for d in devices)}; move them with .to(device)")
    return devices.pop()


class CudaWork:
    """The handle of a collective on CUDA tensors: ``wait()`` makes the current CUDA stream
    wait for it without blocking the host, as torch's NCCL Work does; ``result()`` and
    ``get_future()`` as torch's NCCL Work's."""

    __slots__ = ("_c", "_device", "_future")

    def __init__(self, work, device):
        self._c, self._device, self._future = work, device, None

    def wait(self, timeout=None):
        return self._c.wait_stream(torch.cuda.current_stream(self._device))

    def is_completed(self):
        return self._c.is_completed()

    def result(self):
        """The output tensors, as torch's NCCL Work.result(): [tensor] for all_reduce and
        broadcast, [output] for all_gather_into_tensor and reduce_scatter_tensor, [] for
        barrier; at once, their values ready in stream order (after wait())."""
        return _futures.value(self._c, nccl=True)

    def get_future(self):
        """A CUDA-aware torch.futures.Future of result()'s list, completed at once, as torch's
        NCCL Work's: its wait(), value() and .then() callbacks make the current stream wait for
        the collective, not the host.  A collective already known to have failed gives a
        future holding its exception."""
        if self._future is None:
            future = torch.futures.Future(devices=[self._device])
            # The future's events are recorded on a stream of dptc's that waits for the
            # collective, so the caller's stream does not wait until it uses the future.
            side = _future_stream(self._device)
            try:
                self._c.wait_stream(side)
            except DistError as error:
                future.set_exception(error)
            else:
                with torch.cuda.stream(side):
                    future.set_result(_futures.value(self._c, nccl=True))
            self._future = future
        return self._future


_future_streams = {}   # device -> the stream CudaWork futures record their events on


def _future_stream(device):
    stream = _future_streams.get(device)
    if stream is None:
        stream = _future_streams[device] = torch.cuda.Stream(device)
    return stream


def _check_nccl_redop(collective, redop):
    """ValueError, as torch's NCCL backend raises, for a reduction NCCL lacks: NCCL reduces by
    sum, product, max, min and avg only, so BAND, BOR and BXOR run on CPU tensors alone."""
    if collective not in (OP_ALL_REDUCE, OP_REDUCE_SCATTER) or redop not in BITWISE_REDOPS:
        return
    name = redop_name(redop)
    call = "all_reduce" if collective == OP_ALL_REDUCE else "reduce_scatter_tensor"
    raise ValueError(f"Cannot use ReduceOp.{name} with NCCL: {call}(op=ReduceOp.{name}) on CUDA "
                     f"tensors has no NCCL reduction (NCCL has SUM, PRODUCT, MAX, MIN and AVG "
                     f"only); {call} CPU copies of the tensors on the same group and copy the "
                     f"result back (cpu = tensor.cpu(); ...; tensor.copy_(cpu)), or, for bool "
                     f"flags, use ReduceOp.MAX for BOR and ReduceOp.MIN for BAND")


def _issue_cuda(pg, args, async_op):
    _check_nccl_redop(args[0], args[2])
    device = _cuda_device(args[3], args[4])
    stream = torch.cuda.current_stream(device)
    work = pg.device_engine(device).submit(*args, stream)
    if async_op:
        return CudaWork(work, device)
    work.wait()  # the current stream waits; the Work, dropped, keeps the tensors until done
    return None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, stream=0):
    """Reduces tensor in place across the group (SUM, AVG, MAX, MIN, PRODUCT; BAND, BOR and
    BXOR on integer and bool CPU tensors, as torch's gloo; a complex tensor SUM or AVG, as
    torch's).

    dptc's extension: ``stream`` picks one of the group's independent ordered streams.
    """
    pg = resolve(group)
    if pg is None:
        return None
    staged, target = _staged(tensor, "tensor", read=True, written=True)
    tensor = _as_real(staged, "tensor", op, "all_reduce")
    code = _check_tensor(tensor, "tensor")
    redop = redop_code(op, tensor.dtype)
    work = _issue(pg, OP_ALL_REDUCE, code, redop, tensor, tensor, tensor.numel(), 0, async_op,
                  stream)
    return _written_back(work, target, staged)


def _rank_index(value, argname, what):
    """A rank given as anything torch's collectives take for one (an int, a numpy integer, a
    0-dim integer tensor); TypeError, as torch's, for anything else (a float, a string)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{argname} must be {what} (an int), got {value!r}") from None


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, stream=0):
    """Copies the tensor of rank src (a global rank, or group_src within the group) into
    tensor on every rank."""
    pg = resolve(group)
    if pg is None:
        return None
    staged, target = _staged(tensor, "tensor", read=True, written=True)
    tensor = _as_real(staged, "tensor")
    code = _check_tensor(tensor, "tensor")
    if (src is None) == (group_src is None):
        raise ValueError(f"pass exactly one of src (a global rank) and group_src (a rank of the "
                         f"group), got src={src!r}, group_src={group_src!r}")
    if group_src is None:
        root = pg.group_rank(_rank_index(src, "src", "a global rank"), "src")
    else:
        group_src = _rank_index(group_src, "group_src", "a rank of the group")
        if not 0 <= group_src < pg.size:
            raise ValueError(f"group_src must be a rank of the group in [0, {pg.size}), got "
                             f"{group_src!r}")
        root = group_src
    work = _issue(pg, OP_BROADCAST, code, 0, tensor, tensor, tensor.numel(), root, async_op,
                  stream)
    return _written_back(work, target, staged)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, *,
                           stream=0):
    """Concatenates every rank's input_tensor, by group rank, into output_tensor."""
    pg = resolve(group)
    if pg is None:
        return None
    input_tensor, _ = _staged(input_tensor, "input_tensor", read=True, written=False)
    staged, target = _staged(output_tensor, "output_tensor", read=False, written=True)
    output_tensor = staged
    if isinstance(input_tensor, torch.Tensor) and isinstance(output_tensor, torch.Tensor) \
            and input_tensor.dtype == output_tensor.dtype:
        input_tensor = _as_real(input_tensor, "input_tensor")
        output_tensor = _as_real(output_tensor, "output_tensor")
    code = _check_pair(pg, input_tensor, "input_tensor", output_tensor, "output_tensor")
    work = _issue(pg, OP_ALL_GATHER, code, 0, input_tensor, output_tensor, input_tensor.numel(),
                  0, async_op, stream)
    return _written_back(work, target, staged)


def all_gather_into_tensors(outputs, input_tensor, group=None, async_op=False, *, stream=0):
    """All-gather straight into several outputs (dptc's extension, for FSDP's per-parameter
    storage): ``input_tensor`` is the concatenation of pieces; output j receives every rank's
    j-th piece, by group rank, so it has group size times as many elements as that piece."""
    pg = resolve(group)
    if pg is None:
        return None
    code = _check_tensor(input_tensor, "input_tensor")
    if not isinstance(outputs, (list, tuple)) or not outputs:
        raise TypeError(f"outputs must be a non-empty list of tensors, got {outputs!r}")
    total = 0
    for j, out in enumerate(outputs):
        _check_tensor(out, f"outputs[{j}]")
        if out.dtype != input_tensor.dtype:
            raise TypeError(f"outputs[{j}] has dtype {out.dtype} but input_tensor has "
                            f"{input_tensor.dtype}; they must match")
        if out.numel() % pg.size:
            raise ValueError(f"outputs[{j}] has {out.numel()} elements, not a multiple of the "
                             f"group size {pg.size}")
        total += out.numel() // pg.size
    if total != input_tensor.numel():
        raise ValueError(f"input_tensor has {input_tensor.numel()} elements but the outputs "
                         f"hold pieces of {total} in all; input_tensor must be their "
                         f"concatenation")
    return _issue(pg, OP_ALL_GATHER, code, 0, input_tensor, list(outputs), input_tensor.numel(),
                  0, async_op, stream)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, *,
                          stream=0):
    """Reduces input across ranks and leaves block `rank` of the result in output."""
    pg = resolve(group)
    if pg is None:
        return None
    input, _ = _staged(input, "input", read=True, written=False)
    staged, target = _staged(output, "output", read=False, written=True)
    output = staged
    if isinstance(input, torch.Tensor) and isinstance(output, torch.Tensor) \
            and input.dtype == output.dtype:
        input = _as_real(input, "input", op, "reduce_scatter_tensor")
        output = _as_real(output, "output")
    code = _check_pair(pg, output, "output", input, "input")
    redop = redop_code(op, input.dtype)
    work = _issue(pg, OP_REDUCE_SCATTER, code, redop, input, output, output.numel(), 0,
                  async_op, stream)
    return _written_back(work, target, staged)


# torch 2.13's names for the same two collectives.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def barrier(group=None, async_op=False, device_ids=None, *, stream=0):
    """Returns once every rank of the group has entered the barrier."""
    pg = resolve(group)
    if pg is None:
        return None
    return _issue(pg, OP_BARRIER, 0, 0, None, None, 0, 0, async_op, stream)
