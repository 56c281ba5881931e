"""DDP's sparse gradients: the parameters of ``nn.Embedding``/``nn.EmbeddingBag`` with sparse=True.

[Note: sparse gradients]
torch's DDP gives each such parameter a bucket of its own and all-reduces its sparse COO
gradient through gloo: the gradient is divided by the world size in place, coalesced, every
rank's indices and values are all-gathered, the ranks' tensors are summed in rank order and the
sum is coalesced and written into ``.grad`` in place.  dptc's C reducer holds dense buckets only,
so these parameters stay out of it: at the end of every synced backward, after the dense
write-back, the reducer calls ``reduce_sparse_gradients`` (its ``after_step``), which does the
same arithmetic with the same torch operations over dptc's engine: one all-gather of every rank's
counts, then per parameter one all-gather of its indices and one of its values, each padded to
the largest count.  The result is torch's to the bit.

Beyond torch, which raises "Expected sparse gradient to be defined": a rank on which such a
parameter got no gradient in this backward (unused there, or used by no rank) contributes
nothing; the sum is still written into ``.grad`` wherever some rank had one, and ``.grad``
stays None where none had.  A dense gradient on such a parameter (its weight tied to a dense
use) raises on every rank, as torch's "Expected variable to have sparse gradient".
"""

import torch
import torch.nn as nn

from .collectives import all_gather_into_tensor

__all__ = ["produces_sparse_gradient", "reduce_sparse_gradients"]

_NO_GRADIENT = -1
_DENSE_GRADIENT = -2


def produces_sparse_gradient(module) -> bool:
    """Whether the parameters a module owns directly get sparse gradients (torch's test)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


def reduce_sparse_gradients(params, names, group):
    """Averages the sparse ``.grad`` of every parameter in ``params`` over ``group``, as torch's
    DDP does (see [Note: sparse gradients]).  Every rank must call it with the same list."""
    world = group.size
    local, coalesced = [], []
    for param in params:
        grad = param.grad
        if grad is None:
            local += [_NO_GRADIENT, 0]
            coalesced.append(None)
        elif grad.layout != torch.sparse_coo:
            local += [_DENSE_GRADIENT, 0]
            coalesced.append(None)
        else:
            grad.div_(world)
            grad = grad.coalesce()
            local += [grad._nnz(), grad.sparse_dim()]
            coalesced.append(grad)
    table = torch.empty(world * len(local), dtype=torch.int64)
    all_gather_into_tensor(table, torch.tensor(local, dtype=torch.int64), group=group)
    table = table.view(world, len(params), 2).tolist()
    for j, (param, name, grad) in enumerate(zip(params, names, coalesced)):
        counts = [table[rank][j][0] for rank in range(world)]
        dense = [rank for rank, count in enumerate(counts) if count == _DENSE_GRADIENT]
        if dense:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {name!r} belongs to a module with "
                f"sparse=True, but rank(s) {dense} hold a dense gradient for it (a weight tied "
                f"to a dense use?); give the module sparse=False, or keep its weight untied")
        if all(count == _NO_GRADIENT for count in counts):
            continue
        sparse_dim = max(table[rank][j][1] for rank in range(world))
        _reduce_one(param, grad, counts, sparse_dim, group)


def _reduce_one(param, grad, counts, sparse_dim, group):
    world = group.size
    shape = param.shape
    dense_shape = shape[sparse_dim:]
    longest = max(counts)
    indices = torch.zeros(sparse_dim, longest, dtype=torch.int64)
    values = torch.zeros((longest, *dense_shape), dtype=param.dtype)
    if grad is not None:
        indices[:, :grad._nnz()] = grad._indices()
        values[:grad._nnz()] = grad._values()
    all_indices = torch.empty((world, *indices.shape), dtype=torch.int64)
    all_values = torch.empty((world, *values.shape), dtype=param.dtype)
    if longest:  # every rank knows the counts: all skip alike
        all_gather_into_tensor(all_indices, indices, group=group)
        all_gather_into_tensor(all_values, values, group=group)
    total = None
    for rank, count in enumerate(counts):
        if count == _NO_GRADIENT:
            continue
        part = torch.sparse_coo_tensor(all_indices[rank, :, :count], all_values[rank, :count],
                                       shape, is_coalesced=True, check_invariants=False)
        total = part if total is None else total + part
    total = total.coalesce()
    if param.grad is None:
        param.grad = total
    else:
        param.grad.copy_(total)
