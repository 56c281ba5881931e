"""FSDP1's communication hooks (``FullyShardedDataParallel.register_comm_hook``).

A hook takes over a unit's gradient reduction: ``hook(state, grad)`` under NO_SHARD, which
all-reduces ``grad``, the unit's gradients flattened into one tensor, in place;
``hook(state, grad, output)`` under the sharded strategies, which reduce-scatters ``grad`` (every
rank's shard, one after another, zero-padded: an even split of it gives each rank its shard)
into ``output``, this rank's shard.  The hook divides as it sees fit; dptc divides nothing
after it.  Where in ``grad`` a parameter's elements lie is dptc's layout (each rank's rows of
every parameter, see [Note: sharded layout] in _unit.py), not torch's flat parameter, so a hook
that reads positions sees other ones; a hook that treats elements alike (division, casts,
collectives over even splits) computes what it computes under torch.

torch's own hooks (``torch.distributed.algorithms._comm_hooks.default_hooks``) are recognised
by identity and run on dptc's engine over ``state.process_group``, with torch's arithmetic
step for step: pre-division by ``state.gradient_predivide_factor``, the collective, post-
division, and for the low-precision ones the cast to float16 or bfloat16 before and to
``state.parameter_type`` after (torch 2.13's own raise on CPU, in ``_decompress``'s
``record_stream``).  Any other hook runs as written, its collectives going where it sends them.
"""

import torch
from torch.distributed.algorithms._comm_hooks import default_hooks

from ..collectives import all_reduce, reduce_scatter_tensor


def _divide(tensor, factor):
    if factor > 1:
        tensor.div_(factor)


def _reduce(state, grad, output):
    """torch's allreduce_hook (output None) and reduce_scatter_hook, on dptc's engine; returns
    the reduced tensor."""
    _divide(grad, state.gradient_predivide_factor)
    if output is None:
        all_reduce(grad, group=state.process_group)
        output = grad
    else:
        reduce_scatter_tensor(output, grad, group=state.process_group)
    _divide(output, state.gradient_postdivide_factor)
    return output


def _allreduce(state, grad):
    _reduce(state, grad, None)


def _reduce_scatter(state, grad, output):
    _reduce(state, grad, output)


def _low_precision(dtype):
    def hook(state, grad, output=None):
        compressed = grad.to(dtype)
        shard = None if output is None else torch.empty_like(output, dtype=dtype)
        reduced = _reduce(state, compressed, shard)
        # As torch's _decompress: the result in the parameters' dtype, in the tensor given.
        target = grad if output is None else output
        target.data = reduced.to(state.parameter_type)
    return hook


NATIVE = {
    default_hooks.allreduce_hook: _allreduce,
    default_hooks.reduce_scatter_hook: _reduce_scatter,
    default_hooks.fp16_compress_hook: _low_precision(torch.float16),
    default_hooks.bf16_compress_hook: _low_precision(torch.bfloat16),
}


def resolve(hook):
    """What runs for hook: dptc's version of a torch hook, or the hook itself."""
    try:
        return NATIVE.get(hook, hook)
    except TypeError:       # unhashable callables
        return hook
