"""One fully_shard unit: the sharded layout of its parameters and the tensors its C state
machine (``dptc._C.Unit``, csrc/unit.c) gathers into and reduces from.

[Note: sharded layout]
Parameter p of size d on its shard dim (dim 0 unless shard_placement_fn says otherwise),
sharded over N ranks, is split as ``torch.chunk`` splits it: rank r holds the slices
[r * c, min(d, (r + 1) * c)) with c = ceil(d / N), so for d = 5 on 4 ranks the ranks hold 2, 2,
1 and 0 slices ("rows" below, whatever the dim).  Every rank reserves c rows (the padded piece),
and the pieces of a unit's parameters that share dtypes lie one after another in one flat shard
buffer (a bucket).  A piece holds its rows first, contiguous in p's own dim order (its local
shape is p's with c' <= c on the shard dim), then the padding.  The DTensor a user sees wraps
that unpadded local tensor, so the optimizer, clip_grad_norm_ and DCP read and write the flat
buffer in place, and the buffer is the all-gather's input as it stands (or, under a
param_dtype, after one cast).

The all-gather writes rank r's piece of p into [r * c, (r + 1) * c) rows' worth of p's padded
unsharded storage.  On dim 0 that is the unsharded layout itself: the unsharded parameter is the
view of its first d rows.  Freeing it resizes that storage to 0 bytes and unsharding resizes it
back, so the tensors autograd saved in forward see the gathered values again when backward
gathers.  On another dim the ranks' pieces are concatenated along it into the unsharded
parameter's own storage once the gather is done (torch.cat through an alias, so autograd's
saved tensors do not count it as a modification); the padded storage is freed at once, the
unsharded one at reshard.

Gradients go the other way: ``torch._chunk_cat`` lays the unsharded gradients out by rank (piece
r of every parameter, padded, in the same order as the shard buffer) in the reduce dtype, or, in
a bucket with a parameter sharded on another dim, one copy per parameter and rank; the
reduce-scatter leaves this rank's reduced pieces in a flat buffer whose views become the sharded
gradients.
"""

import contextlib
import math
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import _C
from .._compile import hook as _dynamo_skipped
from .._dtypes import OP_ALL_REDUCE, REDOP_AVG, REDOP_SUM, dtype_code
from .._ranges import Range
from ..group import _env_flag

__all__ = []


class _Param:
    """One managed parameter: the modules that hold it, its piece of the shard buffer, and its
    unsharded storage."""

    def __init__(self, param, locations, size, rank, dim=0):
        self.locations = locations            # [(module, attribute name)], several when tied
        self.owners = []                      # the modules fully_shard was applied to
        # A tensor-parallel parameter (a DTensor on its own mesh) is sharded by its local
        # tensor, see [Note: tensor-parallel parameters].
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        # dp_mesh_dims: tp_spec's mesh is the whole SPMD mesh, see [Note: SPMD meshes].
        self.spmd = None                      # its SpmdLayout
        self.dp_dims = None                   # every data-parallel mesh dim
        self.global_shape = param.shape
        self.global_stride = param.stride()
        param = local_data(param)
        self.shape = param.shape
        self.stride = param.stride() if not param.is_meta else _contiguous_stride(param.shape)
        if self.tp_spec is None:
            self.global_stride = self.stride
        self.orig_dtype = param.dtype
        self.dim = dim                        # the shard dim, see [Note: sharded layout]
        self.extent = self.shape[dim]         # its size
        self.row_numel = math.prod(n for k, n in enumerate(self.shape) if k != dim)
        self.size = size
        self.rows = -(-self.extent // size)   # padded rows per rank
        self.start = self.rank_start(rank)
        self.local_rows = self.rank_rows(rank)
        self.piece = self.rows * self.row_numel
        self.offset = 0                       # in the bucket's shard buffer
        self.sharded = None                   # nn.Parameter(DTensor)
        self.padded = None                    # the gather's output: size pieces
        self.unsharded = None                 # nn.Parameter, full shape
        self.writer = None                    # dim != 0: an alias of unsharded's storage
        self.assembled = False                # dim != 0: unsharded holds the gathered values
        self.hook = None                      # its post-accumulate-grad hook
        self.summoned = None                  # full parameter inside summon_full_params
        self.aliased = False                  # unsharded is a view of the shard buffer
        # While unsharded's storage is freed, its version before: see [Note: freed unsharded
        # storage].
        self.freed_version = None
        # A gather into the unsharded storage failed and may still write to it: never freed.
        self.abandoned = False
        self.accumulated = None               # see [Note: accumulating without sync]
        # FSDP1, between an unsynced backward and the next backward: the .grad put on the
        # sharded parameter, and the sharded gradient it stands in for (see [Note: FSDP1's
        # gradients without sync]).
        self.exposed = None
        self.kept_grad = None

    def rank_start(self, rank):
        return min(self.extent, rank * self.rows)

    def rank_rows(self, rank):
        start = self.rank_start(rank)
        return min(self.extent, start + self.rows) - start

    def rank_shape(self, rank):
        return self.shape_with_rows(self.rank_rows(rank))

    @property
    def local_shape(self):
        return self.shape_with_rows(self.local_rows)

    def shape_with_rows(self, rows):
        shape = list(self.shape)
        shape[self.dim] = rows
        return tuple(shape)

    def narrow(self, full, rank=None):
        """Rank's rows (default: this rank's) of a full-shape tensor."""
        if rank is None:
            return full.narrow(self.dim, self.start, self.local_rows)
        return full.narrow(self.dim, self.rank_start(rank), self.rank_rows(rank))

    def assemble(self):
        """dim != 0: concatenates the gathered pieces along the shard dim into the unsharded
        parameter and frees the gather's output (see [Note: sharded layout])."""
        if self.dim == 0 or self.assembled:
            return
        blocks = [self.padded[r * self.piece:r * self.piece + self.rank_rows(r) * self.row_numel]
                  .view(self.rank_shape(r)) for r in range(self.size) if self.rank_rows(r)]
        with torch.no_grad():
            torch.cat(blocks, dim=self.dim, out=self.writer)
        self.padded.untyped_storage().resize_(0)
        self.assembled = True

    def lay_out_gradient(self, grad, source, offset):
        """Writes grad (full shape) into its piece, at offset, of every rank's row of source
        (size x numel), zeroing the padding, as _chunk_cat does."""
        for r in range(self.size):
            used = self.rank_rows(r) * self.row_numel
            piece = source[r, offset:offset + self.piece]
            if used:
                piece[:used].view(self.rank_shape(r)).copy_(self.narrow(grad, r))
            piece[used:].zero_()

    def keep_pieces(self, first, count, out):
        """Writes the gathered pieces of ranks [first, first + count), padded, into out (count
        pieces one after another): what this rank keeps of p after a reshard to a smaller
        group in forward (see [Note: resharding to a smaller group])."""
        if self.dim == 0:
            flat = self.padded.view(-1)
            out.copy_(flat[first * self.piece:(first + count) * self.piece])
            return
        for k, r in enumerate(range(first, first + count)):
            used = self.rank_rows(r) * self.row_numel
            piece = out[k * self.piece:(k + 1) * self.piece]
            if used:
                piece[:used].view(self.rank_shape(r)).copy_(self.narrow(self.writer, r))
            piece[used:].zero_()

    def wrap_unsharded(self, tensor, requires_grad):
        """The unsharded parameter over tensor (full local shape): tensor itself, or for a
        tensor-parallel parameter the DTensor on its mesh with its placements."""
        if self.tp_spec is not None:
            spec = self.tp_spec
            tensor = DTensor.from_local(tensor, spec.mesh, spec.placements, run_check=False,
                                        shape=self.global_shape, stride=self.global_stride)
        return nn.Parameter(tensor, requires_grad=requires_grad)

    def unsharded_grad(self):
        """The unsharded parameter's gradient as a plain tensor of the full local shape, or
        None: for a tensor-parallel parameter its local tensor, once in the parameter's own
        placements (a gradient that autograd left Partial is reduced over the mesh first,
        as torch's fully_shard does)."""
        grad = self.unsharded.grad
        if grad is None or self.tp_spec is None:
            return grad
        target = tuple(self.tp_spec.placements)
        if self.dp_dims is not None:
            # A Partial on a data-parallel dim stays: the reduction sums it (torch's too).
            target = tuple(grad.placements[i] if i in self.dp_dims else placement
                           for i, placement in enumerate(target))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad._local_tensor

    def alias_shard(self, flat, requires_grad):
        """Makes the unsharded parameter a view of this rank's piece of flat, which holds all
        of it: see [Note: a shard group of one]."""
        self.padded = flat[self.offset:self.offset + self.piece].view(
            (self.rows,) + tuple(self.shape[1:]))
        self.unsharded = self.wrap_unsharded(self.padded[:self.extent], requires_grad)
        self.hook = None
        self.aliased = True
        self.freed_version = None

    def _storage_tensors(self):
        if self.aliased:
            return []
        return [self.padded] if self.dim == 0 else [self.padded, self.writer]

    def allocate(self):
        """Gives the unsharded storage its bytes back, for a gather."""
        self.assembled = False
        for tensor in self._storage_tensors():
            storage = tensor.untyped_storage()
            if storage.size() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    def free(self):
        """Frees the unsharded storage (the module holds the sharded parameter again); the
        caller marks the parameter freed (_mark_freed).  Storage a failed gather may still
        write (see _abandon_on_failure) stays."""
        if self.abandoned:
            return
        for tensor in self._storage_tensors():
            tensor.untyped_storage().resize_(0)

    def local_view(self, flat, offset=None):
        begin = self.offset if offset is None else offset
        return flat[begin:begin + self.local_rows * self.row_numel].view(self.local_shape)

    def local_alias(self, flat):
        """The same elements as local_view, through a tensor whose storage starts at them.
        The DTensor a user sees wraps this: code that takes a tensor's data pointer for its
        storage's (DCP's async staging does) would otherwise copy the whole shard buffer
        from the wrong place."""
        count = self.local_rows * self.row_numel
        if count == 0 or flat.is_meta:
            return self.local_view(flat)
        # A slice of an untyped storage is a storage of its own over the same bytes that
        # keeps the whole alive, on any device, and needs no numpy (torch does not require it,
        # so neither does dptc).
        size = flat.element_size()
        begin = (flat.storage_offset() + self.offset) * size
        storage = flat.untyped_storage()[begin:begin + count * size]
        return flat.new_empty(0).set_(storage, 0, self.local_shape)

    def register(self, param):
        for module, name in self.locations:
            module._parameters[name] = param


def local_data(param):
    """What a unit shards of param: param itself, or a DTensor's local tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


# [Note: freed unsharded storage]
# The rule, for every place dptc gives memory back: memory that a tensor visible to Python or
# saved by autograd may still point at is never freed, unmapped or reused under it; where it
# must go while such a tensor lives, the tensor fails loudly on use, naming the cause, and
# never reads freed memory.  notes/MEMORY.md lists every such place and how it follows this.
#
# Resharding a unit frees its unsharded parameters' storage in place, as torch's fully_shard
# does (see [Note: sharded layout]): the parameter objects live on, in the tensors autograd
# saved in forward and in any reference a script took while the unit was unsharded, and the
# next gather fills the same storage again.  A torch kernel that reads such a tensor while
# its storage is freed reads a null pointer (a segfault, under torch's fully_shard too).
# Backward never does when the unit's pre-backward gathers it first, which every forward of
# the unit arranges (see [Note: a unit of several modules] in _state.py); for whatever else
# could, a freed parameter is marked until its next gather:
# - its version counter (shared with its views) moves FREED_VERSION ahead, so autograd
#   refuses to unpack anything saved from it: "modified by an inplace operation ... is at
#   version 1073741824 (or more); expected version N" instead of a segfault.  Once the next
#   gather is done (wait_unshard) the counter is set back, so a backward after it sees the
#   version it saved (torch's fully_shard keeps its gathers out of the counter alike);
# - its class becomes FreedParameter, whose __torch_function__ lets metadata through (shape,
#   dtype, .grad, hooks, its storage) and raises RuntimeError naming the cause for anything
#   that would read the values.  A tensor-parallel parameter (a DTensor) keeps its class and
#   is guarded by its version only.
# A parameter viewing the shard buffer ([Note: a shard group of one]) frees nothing and is not
# marked.

FREED_VERSION = 1 << 30


def _set_versions(tensors, versions):
    """One call for all of a bucket's parameters (a call per parameter cost 1.5 us each)."""
    if tensors:
        torch._C._autograd._unsafe_set_version_counter(tensors, versions)


def _free(params):
    """Frees the parameters' unsharded storage and marks them freed (see [Note: freed
    unsharded storage]); a parameter already marked, or viewing the shard buffer, is left
    as it is."""
    marked = []
    for p in params:
        p.free()
        if p.freed_version is None and not p.aliased:
            marked.append(p)
    if not marked:
        return
    tensors = tuple(p.unsharded for p in marked)
    versions = tuple(tensor._version for tensor in tensors)
    _set_versions(tensors, tuple(version + FREED_VERSION for version in versions))
    for p, version in zip(marked, versions):
        p.freed_version = version
        if type(p.unsharded) is nn.Parameter:
            p.unsharded.__class__ = FreedParameter


def _unmark(params):
    """Once the gather into them is done: the parameters are no longer marked freed."""
    marked = [p for p in params if p.freed_version is not None]
    if not marked:
        return
    _set_versions(tuple(p.unsharded for p in marked), tuple(p.freed_version for p in marked))
    for p in marked:
        p.freed_version = None
        if type(p.unsharded) is FreedParameter:
            p.unsharded.__class__ = nn.Parameter


@contextlib.contextmanager
def _abandon_on_failure(params):
    """Around a wait for a gather into params' unsharded storage: where the wait raises, the
    gather may go on writing there (a cross-node step blocked in gloo returns only when gloo
    gives up; see [Note: memory of unfinished work] in csrc/module.c), so that storage is
    never freed: the parameters keep it for good, as the work keeps its tensors.  The group
    is aborted by then, so no gather fills it again."""
    try:
        yield
    except BaseException:
        for p in params:
            p.abandoned = True
        raise


def _metadata_functions():
    """The Tensor functions a FreedParameter lets through: they read no values."""
    names = ("grad", "requires_grad", "_version", "shape", "dtype", "device", "is_leaf",
             "grad_fn", "layout", "is_meta", "is_cuda", "is_cpu", "_base", "ndim",
             "is_sparse", "_grad_fn", "names", "itemsize", "nbytes")
    functions = set()
    for name in names:
        attribute = getattr(torch.Tensor, name, None)
        for accessor in ("__get__", "__set__", "__delete__"):
            function = getattr(attribute, accessor, None)
            if function is not None:
                functions.add(function)
    for name in ("size", "dim", "numel", "stride", "storage_offset", "untyped_storage",
                 "element_size", "is_contiguous", "data_ptr", "requires_grad_",
                 "register_hook", "register_post_accumulate_grad_hook", "__hash__",
                 "get_device", "is_floating_point", "is_complex", "_is_view", "nelement"):
        function = getattr(torch.Tensor, name, None)
        if function is not None:
            functions.add(function)
    return functions


_METADATA = _metadata_functions()


class FreedParameter(nn.Parameter):
    """The class of an unsharded parameter while its unit is resharded and its storage freed:
    see [Note: freed unsharded storage]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.__repr__:
            tensor = args[0]
            return (f"FreedParameter(shape={tuple(tensor.shape)}, dtype={tensor.dtype}: "
                    f"freed when its fully_shard unit resharded)")
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"{name} read an unsharded parameter of a fully_shard unit whose storage was "
            f"freed when the unit resharded (after forward, after backward, or by reshard()); "
            f"its values are gone until the unit gathers again.  Take the parameter from the "
            f"module again after the unit's next forward or unshard(), or use the sharded "
            f"DTensor the module holds while the unit is resharded")


def _like_shard(local, shard):
    """local, a tensor of shard's local shape and dtype, as a DTensor laid out as shard:
    on the shard's own spec, without from_local's autograd function (a backward makes one
    per parameter, for its gradient; torch's fully_shard makes its gradients so too)."""
    return DTensor(local, shard._spec, requires_grad=False)


def _lay_out(grads, source, offsets):
    """Writes the (param, full gradient) pairs into source (group size x numel), each rank's
    row holding that rank's pieces one after another (p's at offsets[p]), padded with zeros:
    the reduce-scatter's input."""
    if any(p.dim for p, _ in grads):
        for p, grad in grads:
            p.lay_out_gradient(grad, source, offsets[p])
    elif grads:
        torch._chunk_cat([grad.reshape(p.extent, p.row_numel) for p, grad in grads],
                         dim=0, num_chunks=source.shape[0], out=source)


def _contiguous_stride(shape):
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= dim
    return tuple(reversed(stride))


class _Bucket:
    """The parameters of a unit that share (original, compute, reduce) dtypes: one shard buffer,
    one C state machine, one all-gather and one reduce-scatter each."""

    def __init__(self, params, orig_dtype, compute_dtype, reduce_dtype, engine, current_stream,
                 num_streams, size):
        self.params = params
        self.orig_dtype = orig_dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.size = size
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.piece
        self.numel = offset                  # of one rank's shard
        self.gathered = [p for p in params if p.piece > 0]   # params with rows to move
        self.flat = None                     # shard buffer, orig dtype
        self.c = _C.Unit(engine, len(params), gather_stream=0,
                         reduce_stream=1 if num_streams > 1 else 0,
                         current_stream=current_stream)
        self.reduce_output = None            # the reduce-scatter's output until finalized,
                                             # or the list of gradients reduced in place
        self.reduce_had_grad = None          # which parameters had a gradient to reduce
        self.reduce_offsets = None           # {param: offset} of the reduction's layout
        self.redop = None                    # of the reduction in flight
        self.partial = None                  # HSDP: reduce-scattered, not yet all-reduced
        self.partial_had = None
        self.kept = None                     # after a reshard to a smaller group: its input
        self.hooked = False                  # reduced by FSDP1's communication hook


class ReduceRing:
    """[Note: reduce inputs in shared memory]
    On one node the shared-memory transport reduce-scatters an input that lies in a shared
    buffer (the same offset of it on every rank) straight from the peers' memory; any other
    input it first copies through its staging slots, which costs several times the reduction
    itself (6.4 MB at 2 ranks: 3.9 ms staged, 0.5 ms shared).  A ring holds two shared buffers
    per (shard group, reduce dtype), each as large as the largest unit's reduce inputs of that
    dtype.  Units take them in turn as their reductions start; before a buffer is reused, the
    reduction that last read it is finished (at most two are in flight anyway, see [Note: one
    training step]).

    The buffers keep their pages from one step to the next, as a GPU caching allocator keeps
    its blocks: pages given back at the end of every backward (SharedBuffer.discard) must be
    faulted in again, one at a time, by the next backward's _chunk_cat, and on the
    development machine that made a step of benchmarks/fsdp_step.py about 4 ms (7 %) slower
    (backward 36.0-37.7 against 31.4-33.6 ms, 3 alternating pairs).  They hold twice the
    largest unit's reduce inputs; DPTC_FSDP_RELEASE_REDUCE_BUFFERS=1 gives the pages back
    after every backward instead (the mappings stay either way)."""

    def __init__(self, group, nbytes, release_pages=False):
        self.buffers = [group._c.share(nbytes), group._c.share(nbytes)]
        self.owners = [None, None]             # the State whose reduction last used each
        self.next = 0
        self.release_pages = release_pages

    def take(self, owner, finish):
        index = self.next
        self.next ^= 1
        previous = self.owners[index]
        if previous is not None:
            # Its own earlier reduction too (a unit of several modules reduces twice in one
            # backward): nothing may still read the buffer when it is laid out again.
            finish(previous)
        self.owners[index] = owner
        return self.buffers[index]

    def end_backward(self):
        """Every reduction that read the ring is finished: the next backward starts afresh."""
        self.owners = [None, None]
        self.next = 0
        if self.release_pages:
            for buffer in self.buffers:
                buffer.discard()


class SpmdLayout:
    """[Note: SPMD meshes]
    Under ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)`` every parameter is already a
    DTensor on the whole SPMD mesh (data-parallel and model-parallel dims alike), placed
    Replicate() on the data-parallel dims.  The unit shards its local tensor over the group
    of the shard dims (several are flattened into one group, as torch flattens them) and,
    with replicate dims, all-reduces over theirs as HSDP; replicate dims alone keep every
    parameter whole and all-reduce (torch's DDP through fully_shard: a shard group of one).
    The unsharded parameter is the original DTensor's layout over the gathered local
    tensor, and its gradient keeps a Partial() on the data-parallel dims (the reduction sums
    those), as torch's does.  The shard is placed as torch's fully_shard places it: each
    shard dim Shard(d), or _StridedShard(d, split_factor) where later mesh dims split d too,
    on the SPMD mesh itself; where several shard dims were flattened, on the mesh whose first
    shard dim is the flattened one ((replicate, flattened) under HSDP), the others and the
    replicate dims dropped, and the remaining dims in their order.  (A later torch may place
    these differently; tests/test_fsdp_tp.py compares with the installed one.)"""

    def __init__(self, mesh, shard_names, replicate_names, dp_mesh):
        names = mesh.mesh_dim_names
        self.mesh = mesh
        self.names = names
        self.shard_names, self.replicate_names = tuple(shard_names), tuple(replicate_names)
        self.shard_indices = [names.index(name) for name in shard_names]
        self.dp_dims = frozenset(self.shard_indices +
                                 [names.index(name) for name in replicate_names])
        self.hsdp = bool(shard_names and replicate_names)
        self.spec_mesh = mesh
        if len(shard_names) > 1:
            submeshes = []
            for i, name in enumerate(names):
                if name == shard_names[0]:
                    submeshes.append(dp_mesh)
                elif name not in shard_names and not (self.hsdp and name in replicate_names):
                    submeshes.append(mesh[name])
            self.spec_mesh = DeviceMesh._concatenate(submeshes)

    def placements(self, original, dim):
        """(mesh, placements) of the shard of a parameter placed ``original`` on the SPMD
        mesh, sharded on its dim ``dim``."""
        placements = list(original)
        mesh = self.mesh
        for index in self.shard_indices:
            split = math.prod(mesh.size(j) for j in range(index + 1, mesh.ndim)
                              if isinstance(original[j], (Shard, _StridedShard))
                              and original[j].dim == dim)
            placements[index] = (_StridedShard(dim, split_factor=split) if split > 1
                                 else Shard(dim))
        if len(self.shard_names) <= 1:
            return mesh, tuple(placements)
        out = []
        for i, name in enumerate(self.names):
            if name == self.shard_names[0]:
                out += [Replicate(), placements[i]] if self.hsdp else [placements[i]]
            elif name not in self.shard_names and not (self.hsdp and
                                                        name in self.replicate_names):
                out.append(placements[i])
        return self.spec_mesh, tuple(out)


def _retype(holder, value, local):
    """holder (a parameter's DTensor .grad) takes value's dtype, layout and memory, local its
    local tensor, which may differ from the parameter's dtype (param_dtype,
    keep_low_precision_grads): through .data, as .grad must otherwise match the parameter's
    dtype, and through _local_tensor too, which DTensor's .data leaves in place."""
    holder.data = value
    holder._local_tensor = local


def _assign_grad(param, grad):
    """param.grad = grad (a DTensor or None), in grad's dtype even where it differs from the
    parameter's (see _retype)."""
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    local = grad._local_tensor
    param.grad = DTensor.from_local(torch.empty(local.shape, dtype=param.dtype,
                                                device=local.device),
                                    grad.device_mesh, grad.placements, run_check=False,
                                    shape=grad.shape, stride=grad.stride())
    _retype(param.grad, grad, local)


class Unit:
    """The parameters one fully_shard call manages, on the mesh's shard group (and, for HSDP,
    its replicate group)."""

    def __init__(self, params_and_locations, mesh, shard_group, replicate_group, mp_policy,
                 shard_dims=None, spmd=None):
        self.mesh = mesh
        self.group = shard_group
        self.replicate_group = replicate_group
        # CUDA parameters move through the groups' NCCL engines, CPU ones through shared
        # memory; meta parameters are materialised on the CPU (reset_sharded).
        devices = {param.device for param, _ in params_and_locations if not param.is_meta}
        if len(devices) > 1:
            raise ValueError(f"a fully_shard unit's parameters must be on one device, got "
                             f"{sorted(str(d) for d in devices)}; move the module with .to()")
        self.device = devices.pop() if devices else torch.device("cpu")
        size, rank = shard_group.size, shard_group.rank
        self.hsdp = replicate_group is not None
        shard_dims = shard_dims or [0] * len(params_and_locations)
        self.params = [_Param(param, locations, size, rank, dim)
                       for (param, locations), dim in zip(params_and_locations, shard_dims)]
        if spmd is not None:   # an SpmdLayout: dp_mesh_dims
            for p in self.params:
                p.spmd, p.dp_dims = spmd, spmd.dp_dims
        self.mp_policy = mp_policy
        self.buckets = self._make_buckets()
        self.divide_factor = None        # set_gradient_divide_factor
        self.force_sum = False           # set_force_sum_reduction_for_comms
        self.all_reduce_hook = None      # set_all_reduce_hook: (hook, CUDA stream or None)
        self.comm_hook = None            # FSDP1's register_comm_hook: (state, hook)
        self.label = "unit"              # its name in profiler ranges, see set_label
        # reshard_after_forward as an int: the smaller group backward gathers over, or None.
        self.post_forward_group = None
        # FSDP1's MixedPrecision(keep_low_precision_grads=True), see _keep_low_precision.
        self.keep_low_precision_grads = False
        # See [Note: accumulating without sync]; FSDP1 accumulates in param_dtype and shows
        # the sum in .grad (see [Note: FSDP1's gradients without sync]).
        self.accumulate_in_reduce_dtype = True
        self.expose_unsynced_grads = False
        self.any_exposed = False          # some parameter's .grad is _expose_unsynced's
        originals = {id(p): param for p, (param, _) in zip(self.params, params_and_locations)}
        for bucket in self.buckets:
            self._shard(bucket, originals)

    def _make_buckets(self):
        """The parameters grouped by (original, compute, reduce) dtypes, one _Bucket each."""
        by_dtypes = {}
        policy = self.mp_policy
        for p in self.params:
            compute = p.orig_dtype
            if policy.param_dtype is not None and p.orig_dtype.is_floating_point:
                compute = policy.param_dtype
            reduce = compute
            if policy.reduce_dtype is not None and p.orig_dtype.is_floating_point:
                reduce = policy.reduce_dtype
            by_dtypes.setdefault((p.orig_dtype, compute, reduce), []).append(p)
        group = self.group
        return [_Bucket(ps, *dtypes, self.engine(group), self.current_stream(),
                        group.num_streams, group.size)
                for dtypes, ps in by_dtypes.items()]

    def engine(self, group):
        """The C engine that moves this unit's tensors in `group`."""
        return group.device_engine(self.device) if self.device.type == "cuda" else group._c

    def current_stream(self):
        """For a CUDA unit, what its collectives follow: () -> the current CUDA stream."""
        if self.device.type != "cuda":
            return None
        device = self.device
        return lambda: torch.cuda.current_stream(device)

    # -- layout -------------------------------------------------------------------------------

    def _shard(self, bucket, originals):
        on_meta = any(originals[id(p)].is_meta for p in bucket.params)
        bucket.flat = self._new_flat(bucket, on_meta)
        for p in bucket.params:
            orig = originals[id(p)]
            local = p.local_alias(bucket.flat)
            if not orig.is_meta and p.local_rows:
                with torch.no_grad():
                    local.copy_(p.narrow(local_data(orig).detach()))
            p.sharded = nn.Parameter(self._dtensor(local, p), requires_grad=orig.requires_grad)
            self._make_unsharded(bucket, p, orig.requires_grad, on_meta)
            _free([p])
            p.register(p.sharded)

    def _make_unsharded(self, bucket, p, requires_grad, on_meta=False):
        """p's unsharded parameter and the storage the gather writes, in the compute dtype."""
        kind = dict(dtype=bucket.compute_dtype, device=self.device)
        p.writer, p.hook, p.aliased, p.freed_version = None, None, False, None
        if self._aliases(bucket, p) and not on_meta:
            p.alias_shard(bucket.flat, requires_grad)
        elif p.dim == 0:
            p.padded = torch.empty((self.group.size * p.rows,) + tuple(p.shape[1:]), **kind)
            p.unsharded = p.wrap_unsharded(p.padded[:p.extent], requires_grad)
        else:
            p.padded = torch.empty(self.group.size * p.piece, **kind)
            full = torch.empty(p.shape, **kind)
            p.unsharded = p.wrap_unsharded(full, requires_grad)
            # Its own version counter: writing the gathered values through it does not
            # invalidate the tensors autograd saved from the unsharded parameter.
            p.writer = torch.empty(0, **kind).set_(full.untyped_storage(), 0, full.shape,
                                                   full.stride())

    def _aliases(self, bucket, p):
        """[Note: a shard group of one]
        Sharded over one rank (FSDP1's NO_SHARD, or a mesh whose shard dim has size 1), a
        parameter's shard is all of it.  Where the gather would copy it unchanged (a CPU
        parameter on dim 0, no param_dtype cast, not tensor-parallel), the unsharded parameter
        is a view of the shard buffer instead: unshard's all-gather then has its input as its
        output, which the transport leaves as it is (see [Note: a group of one] in
        csrc/shm.c), and resharding frees nothing.  Per unit and step that saves two copies
        of its parameters and the page faults of allocating them twice.  The optimizer
        updates the buffer in place between backward and the next forward, as it updates a
        shard that the next forward gathers."""
        return (self.group.size == 1 and self.device.type == "cpu" and p.dim == 0 and
                p.tp_spec is None and bucket.compute_dtype == bucket.orig_dtype)

    def _reduces_in_place(self, bucket, grads, after):
        """Whether bucket's gradients are reduced where autograd left them: over a shard
        group of one (see [Note: a shard group of one]), each parameter's gradient is its
        sharded gradient whole.  Then nothing is laid out in a reduce buffer: the replicas'
        all-reduce (HSDP's, or NO_SHARD's across ranks) runs in place on the gradients, piece
        by piece (the transport stages them as one operand, see [Note: several pieces] in
        csrc/shm.c), and they become the sharded gradients.  Per unit and step that saves
        the copy of its gradients into freshly allocated memory, and the page faults.  Held
        where the reduction needs nothing of a flat buffer: no dtype cast, contiguous
        gradients, no set_all_reduce_hook (its hook takes the flat output), and no partial
        sums across backwards (set_requires_all_reduce(False))."""
        if self.group.size != 1 or self.device.type != "cpu" or \
                self.all_reduce_hook is not None or bucket.partial is not None:
            return False
        if self.replicate_group is not None and after is None:
            return False
        if not (bucket.compute_dtype == bucket.orig_dtype == bucket.reduce_dtype):
            return False
        return all(p.dim == 0 and p.tp_spec is None and grad.dtype == bucket.reduce_dtype and
                   grad.is_contiguous() for p, grad in grads)

    def _new_flat(self, bucket, on_meta=False):
        """A zeroed shard buffer for bucket.  On one CPU node, where the all-gather's input is
        the buffer itself (no param_dtype cast), it lies in memory every rank of the shard
        group maps: the all-gather then copies each rank's shard straight from its owner's
        buffer into the unsharded storage, with nothing staged (all_gather_from_shared in
        csrc/shm.c).  Collective in that case, like every shard buffer's creation: each rank
        makes its units' buffers in the same order."""
        shared = _env_flag("DPTC_FSDP_SHARED_GATHER", True)   # checked even where moot
        if on_meta:
            return torch.zeros(bucket.numel, dtype=bucket.orig_dtype, device="meta")
        if self.on_one_cpu_node and bucket.compute_dtype == bucket.orig_dtype and shared:
            return self.group.empty_shared(bucket.numel, bucket.orig_dtype)
        return torch.zeros(bucket.numel, dtype=bucket.orig_dtype, device=self.device)

    @property
    def on_one_cpu_node(self):
        """Whether the shard group is several CPU ranks of one node, whose collectives can
        read shared buffers in place (the shard buffers, the reduce ring)."""
        return self.device.type == "cpu" and self.group.size > 1 and self.group.nnodes == 1

    def _dtensor(self, local, p):
        """p's shard (or sharded gradient) as the DTensor a user sees.

        [Note: tensor-parallel parameters]
        A parameter that is already a DTensor on a mesh of its own (tensor parallelism:
        parallelize_module made it, on the tp dimension of the mesh whose dp dimension this
        unit shards over) is sharded by its local tensor, which the gathers and reductions move
        as they move a plain parameter.  As under torch's fully_shard, its shard is a DTensor on
        the two meshes concatenated, (dp, tp), placed on dp as Shard(d) or, where the tensor-
        parallel placement splits d too, as _StridedShard(d, split_factor) (the dp pieces lie
        inside the tp pieces), followed by its tensor-parallel placements; HSDP puts
        Replicate() first.  The unsharded parameter forward and backward see is the DTensor
        of the tensor-parallel layout over the gathered local tensor, so the tensor-parallel
        modules run unchanged, and its gradient is taken in those placements."""
        dp = Shard(p.dim)
        if p.dp_dims is not None:
            return self._spmd_dtensor(local, p)
        if p.tp_spec is None:
            mesh, placements = self.mesh, (dp,)
        else:
            mesh = self._spmd_mesh(p.tp_spec.mesh)
            split = p.tp_spec.num_shards_map[p.dim]
            if split > 1:
                dp = _StridedShard(p.dim, split_factor=split)
            placements = (dp,) + tuple(p.tp_spec.placements)
        if self.hsdp:
            placements = (Replicate(),) + placements
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=p.global_shape, stride=p.global_stride)

    def _spmd_dtensor(self, local, p):
        """The shard of p, a parameter on the whole SPMD mesh: see SpmdLayout."""
        mesh, placements = p.spmd.placements(p.tp_spec.placements, p.dim)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=p.global_shape, stride=p.global_stride)

    def _spmd_mesh(self, tp_mesh):
        """The unit's mesh and a tensor-parallel mesh, concatenated (one per tp mesh)."""
        meshes = self.__dict__.setdefault("_spmd_meshes", {})
        mesh = meshes.get(id(tp_mesh))
        if mesh is None:
            mesh = meshes[id(tp_mesh)] = DeviceMesh._concatenate([self.mesh, tp_mesh])
        return mesh

    def meta_params(self, names):
        """The qualified names of the parameters made on the meta device that are still
        there (their values were never set); names maps modules to theirs."""
        left = []
        for p in self.params:
            module, name = p.locations[0]
            if module._parameters[name] is p.sharded and p.sharded._local_tensor.is_meta:
                prefix = names.get(module, "root")
                left.append(name if prefix == "root" else f"{prefix}.{name}")
        return left

    def reset_sharded(self):
        """Adopts parameters that replaced ours on the modules (``to_empty``,
        ``load_state_dict(assign=True)``, ``.to(dtype)``): their values move into the shard
        buffer and their local tensors become views of it again."""
        adopted = []
        for p in self.params:
            module, name = p.locations[0]
            current = module._parameters[name]
            if current is p.unsharded or current is p.summoned:
                continue        # ours: gathered, or FSDP1's summon_full_params
            if current is not p.sharded:
                if not isinstance(current, DTensor):
                    raise TypeError(f"{type(module).__name__}.{name} was replaced by a "
                                    f"{type(current).__name__}; fully_shard's parameters "
                                    f"must stay DTensors (load values with copy_ or "
                                    f"set_model_state_dict)")
                p.sharded = current
            adopted.append(p)
        if any(p.sharded.dtype != p.orig_dtype for p in adopted):
            self._recast()
            return
        for bucket in self.buckets:
            if bucket.flat.is_meta:
                bucket.flat = self._new_flat(bucket)
                for p in bucket.params:
                    if self._aliases(bucket, p):
                        p.alias_shard(bucket.flat, p.sharded.requires_grad)
            for p in bucket.params:
                if p not in adopted:
                    continue
                view = p.local_view(bucket.flat)
                local = p.sharded._local_tensor
                if local.is_meta or view.numel() and local.data_ptr() != view.data_ptr():
                    if not local.is_meta and p.local_rows:
                        with torch.no_grad():
                            view.copy_(local)
                    p.sharded._local_tensor = p.local_alias(bucket.flat)
                p.register(p.sharded)

    def _recast(self):
        """[Note: changing dtype after fully_shard]
        ``model.to(dtype)`` (``.double()``, ``.half()``) after fully_shard casts the sharded
        parameters, as torch's does.  The buckets are laid out by dtype, so the unit is laid
        out anew from the parameters it manages: buckets for the new dtypes (and the compute
        and reduce dtypes the policy gives them), shard buffers holding the cast values, and
        unsharded storage in the new compute dtype.  The parameters stay the same objects
        (an optimizer made before keeps them) and their gradients keep the cast values.
        Collective where the shard buffers are (see _new_flat): every rank casts its model
        at the same point, as it must under torch's too.  Allowed between steps only, with
        the unit sharded and no reduction in flight."""
        for bucket in self.buckets:
            if bucket.c.state != "sharded" or bucket.c.reducing or bucket.partial is not None:
                raise RuntimeError(
                    f"the parameters of {self.label} changed dtype while it was in use "
                    f"(unsharded, or gradients being reduced); cast the model between steps")
        for p in self.params:
            if p.hook is not None:
                p.hook.remove()
            p.orig_dtype = p.sharded.dtype
            p.accumulated = None
        self.buckets = self._make_buckets()
        for bucket in self.buckets:
            bucket.flat = self._new_flat(bucket, any(p.sharded._local_tensor.is_meta
                                                     for p in bucket.params))
            for p in bucket.params:
                local = p.sharded._local_tensor
                alias = p.local_alias(bucket.flat)
                if not local.is_meta and p.local_rows:
                    with torch.no_grad():
                        alias.copy_(local)
                p.sharded._local_tensor = alias
                self._make_unsharded(bucket, p, p.sharded.requires_grad, alias.is_meta)
                _free([p])
                p.register(p.sharded)
        self.set_label(self.label)

    def set_label(self, label):
        """Names the unit in profiler ranges, e.g. ``dptc::all_gather blocks.2`` (see [Note:
        profiler ranges] in dptc/_ranges.py)."""
        self.label = label
        for bucket in self.buckets:
            bucket.c.label = label

    # -- parameters ---------------------------------------------------------------------------

    @property
    def state(self):
        return self.buckets[0].c.state if self.buckets else "sharded"

    def unshard(self, in_backward=False):
        """Starts gathering every bucket (a no-op for one already unsharding or unsharded):
        from the shards over the shard group, or, in backward after
        reshard_to_smaller_group, from what this rank kept, over the smaller group."""
        for bucket in self.buckets:
            if bucket.c.state != "sharded":
                continue
            if not in_backward:
                bucket.kept = None
            gathered = bucket.gathered
            for p in gathered:
                p.allocate()
            if not gathered:
                continue
            code = dtype_code(bucket.compute_dtype)
            if bucket.kept is None and all(p.aliased for p in gathered):
                bucket.c.unshard(code, None, [], 0)     # the shard buffer is all of it
                continue
            outputs = [p.padded for p in gathered]
            if bucket.kept is not None:
                group, kept = self.post_forward_group, bucket.kept
                bucket.c.unshard(code, kept, outputs, kept.numel(), self.engine(group))
                continue
            source = bucket.flat
            if bucket.compute_dtype != bucket.orig_dtype:
                source = source.to(bucket.compute_dtype)
            bucket.c.unshard(code, source, outputs, bucket.numel)

    def wait_unshard(self):
        """Waits for the gathers and puts the unsharded parameters on the modules."""
        for bucket in self.buckets:
            if bucket.c.state == "sharded":
                if bucket.gathered:
                    raise RuntimeError("wait_unshard before unshard")
            else:
                with _abandon_on_failure(bucket.gathered):
                    bucket.c.wait_unshard()
                bucket.kept = None
                for p in bucket.gathered:
                    p.assemble()
            _unmark(bucket.params)
            for p in bucket.params:
                p.unsharded.requires_grad_(p.sharded.requires_grad)
                self._hook(p)
                p.register(p.unsharded)

    def reshard(self):
        """Frees the unsharded storage and puts the sharded parameters back on the modules."""
        for bucket in self.buckets:
            with _abandon_on_failure(bucket.gathered):
                bucket.c.reshard()
            bucket.kept = None
            _free(bucket.params)
            for p in bucket.params:
                p.register(p.sharded)

    def reshard_to_smaller_group(self):
        """After forward, with reshard_after_forward an int: keeps this rank's share of the
        unsharded parameters over post_forward_group, then reshards, so that backward
        gathers over that group alone.  [Note: resharding to a smaller group]
        reshard_after_forward=k (a divisor of the shard group's size N) splits the shard
        group into blocks of k consecutive ranks, as torch's fully_shard does (its mesh viewed
        as (-1, k)).  In a unit's post-forward the member of rank j in its block keeps pieces
        [j * N/k, (j + 1) * N/k) of every gathered parameter (padded, in the compute dtype),
        N/k of the N ranks' pieces, in one tensor per bucket laid out as the shard buffer
        with every piece N/k times as long.  Backward's gather over the block puts them back
        where the full gather would; the tensor is freed once that gather is done, or when
        the unit reshards (a forward that is not a recomputation gathers from the shards
        again: an optimizer step may have changed them).  Between forward and backward a
        rank so holds 1/k of each unit's unsharded bytes besides its shards, where
        reshard_after_forward=True holds none and False all; the modules hold the sharded
        parameters meanwhile."""
        group = self.post_forward_group
        span = self.group.size // group.size
        first = group.rank * span
        for bucket in self.buckets:
            kept = None
            if bucket.c.state == "unsharded" and bucket.gathered:
                kept = torch.empty(span * bucket.numel, dtype=bucket.compute_dtype,
                                   device=self.device)
                with torch.no_grad():
                    for p in bucket.gathered:
                        p.keep_pieces(first, span,
                                      kept[span * p.offset:span * (p.offset + p.piece)])
            with _abandon_on_failure(bucket.gathered):
                bucket.c.reshard()
            bucket.kept = kept
            _free(bucket.params)
            for p in bucket.params:
                p.register(p.sharded)

    def kept_bytes(self):
        """Bytes this unit keeps after reshard_to_smaller_group until backward gathers."""
        return sum(b.kept.numel() * b.kept.element_size() for b in self.buckets
                   if b.kept is not None)

    def summon(self, with_grads=False):
        """Puts full parameters in their original dtype on the modules (FSDP1's
        summon_full_params), gathered from the shards, with their full gradients if asked."""
        self.reshard()
        for p in self.params:
            full = p.sharded.full_tensor().detach()
            p.summoned = nn.Parameter(full, requires_grad=p.sharded.requires_grad)
            grad = p.sharded.grad if with_grads else None
            if grad is not None and grad.dtype != full.dtype:   # keep_low_precision_grads
                p.summoned.grad = torch.empty_like(full)
                p.summoned.grad.data = grad.full_tensor()
            elif grad is not None:
                p.summoned.grad = grad.full_tensor()
            p.register(p.summoned)

    def is_summoned(self):
        """Whether the modules hold this unit's summon() parameters."""
        return any(p.summoned is not None for p in self.params)

    def unsummon(self, writeback):
        """Puts the sharded parameters back, first copying this rank's rows of the full ones
        into the shards when writeback is set."""
        with torch.no_grad():
            for bucket in self.buckets:
                for p in bucket.params:
                    if writeback and p.local_rows and p.summoned is not None:
                        p.local_view(bucket.flat).copy_(p.narrow(p.summoned))
                    p.summoned = None
                    p.register(p.sharded)

    # -- gradients ----------------------------------------------------------------------------

    def reset_ready(self):
        """A new backward is coming: no gradient is complete yet, and a frozen parameter's
        never will be."""
        for bucket in self.buckets:
            bucket.c.reset_ready()
            for i, p in enumerate(bucket.params):
                if not p.sharded.requires_grad:
                    bucket.c.grad_ready(i)

    def grad_hooks(self, on_complete):
        """Calls on_complete(self) when the last gradient of the unit is complete: a
        post-accumulate-grad hook on each unsharded parameter (registered once the parameter
        requires grad; a frozen one may be unfrozen later) counts it in the C unit."""
        self.on_complete = on_complete
        for p in self.params:
            self._hook(p)

    # [Note: hooks hold their unit weakly]
    # torch keeps a tensor's post-accumulate-grad hooks in C++ (its autograd metadata), and
    # Python's garbage collector does not look into them: a cycle from the unsharded parameter
    # through its hook back to the parameter is never collected.  A hook that held its unit
    # (or its bucket, whose params hold the unsharded parameters) kept every dropped
    # fully_shard and FSDP1 model alive, with its shard buffers, unsharded storage and
    # shared-memory reduce rings: about 10 memory maps per model in tests/test_soak.py.  So the
    # hook reaches the unit and its bucket through weak references; while the model lives they
    # always resolve (the unit holds its buckets, the module its unit), and once it is dropped
    # a graph that outlived it has nothing to count.

    def _hook(self, p):
        if p.hook is not None or not p.unsharded.requires_grad:
            return
        bucket = next(b for b in self.buckets if p in b.params)
        index = bucket.params.index(p)
        # Weak: see [Note: hooks hold their unit weakly].
        unit_ref, bucket_ref = weakref.ref(self), weakref.ref(bucket)

        # A frame dynamo skips: see [Note: torch.compile] in dptc/_compile.py.
        @_dynamo_skipped
        def hook(_param):
            unit, bucket = unit_ref(), bucket_ref()
            if unit is None or bucket is None:
                return   # the model was dropped while a graph through it lived on
            if bucket.c.grad_ready(index) and all(
                    b.c.ready == len(b.params) for b in unit.buckets):
                unit.on_complete(unit)
        p.hook = p.unsharded.register_post_accumulate_grad_hook(hook)

    def has_frozen_params(self):
        return any(not p.sharded.requires_grad for p in self.params)

    def has_unsharded_grads(self):
        return any(p.unsharded.grad is not None or p.accumulated is not None
                   for p in self.params)

    # [Note: accumulating without sync]
    # Under set_requires_gradient_sync(False) autograd accumulates each micro-batch's gradient
    # into the unsharded parameter's .grad, in the compute dtype.  As torch's fully_shard
    # does, a gradient in another dtype than its bucket's reduce dtype (bf16 under
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) is moved after each
    # unsynced backward into an accumulator in the reduce dtype, so that the micro-batches
    # add up in fp32; the synced backward's reduce adds its own gradient to it and reduces
    # the sum.  FSDP1's no_sync accumulates in param_dtype, as torch's FSDP1 does.

    def accumulate_unsynced(self):
        """After a backward without sync: moves the unsharded gradients into their
        accumulators (see [Note: accumulating without sync]), or under FSDP1 shows them in
        .grad (see [Note: FSDP1's gradients without sync])."""
        if self.expose_unsynced_grads:
            self._expose_unsynced()
        if not self.accumulate_in_reduce_dtype:
            return
        for bucket in self.buckets:
            for p in bucket.params:
                if p.unsharded.grad is None or p.unsharded.grad.dtype == bucket.reduce_dtype:
                    continue
                p.accumulated = self._take_grad(p).to(bucket.reduce_dtype)

    # [Note: FSDP1's gradients without sync]
    # torch's FSDP1 leaves what backwards under no_sync() accumulated in .grad, as DDP does:
    # this rank's own sum, full-shaped, which clip_grad_norm_ and the optimizer see and
    # zero_grad clears.  dptc's FSDP1 does the same: after an unsynced backward each sharded
    # parameter's .grad becomes a DTensor, Replicate on the unit's mesh, over the unsharded
    # gradient itself (no copy; in param_dtype, set through .data where that differs from the
    # parameter's dtype, as keep_low_precision_grads does).  What the user did to it is taken
    # back before the unit's next backward reads or adds to the sum (reclaim_unsynced, from
    # the unit's pre-backward and, for a unit that backward does not reach, the end of
    # backward): .grad set to None (zero_grad) drops the sum; a tensor put in its place
    # becomes the sum; changes in place (zero_, clip_grad_norm_'s mul_) are in it already.  A
    # sharded gradient an earlier synced backward left waits aside meanwhile and comes back
    # then, unless .grad was set to None (under NO_SHARD, where that gradient is whole, it
    # joins the sum instead, as in torch's).  fully_shard keeps the sum hidden, as torch's
    # does.

    def _expose_unsynced(self):
        for p in self.params:
            grad = p.unsharded.grad
            if grad is None or p.sharded is p.unsharded or p.tp_spec is not None:
                continue
            if p.exposed is None and p.sharded.grad is not None and self.group.size == 1:
                # Shards of one rank (NO_SHARD): the earlier gradient joins the sum, as
                # torch's NO_SHARD accumulates into it.
                grad.add_(p.sharded.grad._local_tensor.reshape(grad.shape).to(grad.dtype))
            elif p.exposed is None:
                p.kept_grad = p.sharded.grad
            mesh = p.sharded.device_mesh
            _assign_grad(p.sharded, DTensor.from_local(grad, mesh, [Replicate()] * mesh.ndim,
                                                       run_check=False))
            p.exposed = p.sharded.grad
            self.any_exposed = True

    def reclaim_unsynced(self):
        """Before a backward: takes back the gradients _expose_unsynced showed in .grad (see
        [Note: FSDP1's gradients without sync])."""
        if not self.any_exposed:
            return
        self.any_exposed = False
        for p in self.params:
            exposed, p.exposed = p.exposed, None
            if exposed is None:
                continue
            current, kept, p.kept_grad = p.sharded.grad, p.kept_grad, None
            if current is None:
                p.unsharded.grad = None
                continue
            if current is not exposed:
                local = current.full_tensor() if isinstance(current, DTensor) else current
                p.unsharded.grad = local.detach().to(p.unsharded.dtype).reshape(p.shape)
            _assign_grad(p.sharded, kept)

    def _take_grad(self, p):
        """p's gradient to reduce, its accumulator included, or None; clears both."""
        grad = p.unsharded_grad()
        if p.accumulated is not None:
            grad = p.accumulated if grad is None else p.accumulated.add_(grad)
            p.accumulated = None
        p.unsharded.grad = None
        return grad

    def reduce_input_bytes(self):
        """{reduce dtype: bytes of this unit's reduce inputs in that dtype}."""
        sizes = {}
        for bucket in self.buckets:
            nbytes = self.group.size * bucket.numel * bucket.reduce_dtype.itemsize
            sizes[bucket.reduce_dtype] = sizes.get(bucket.reduce_dtype, 0) + nbytes
        return sizes

    def reduce(self, all_reduce=True, shared_input=None, unused=False):
        """Starts reducing the unsharded gradients into this rank's pieces, and frees them.
        HSDP: the pieces are then all-reduced across replicas, unless all_reduce is False
        (set_requires_all_reduce), which keeps them as a partial sum for a later backward.
        unused (set_reduce_scatter_unused_params): every bucket is reduced, with zeros for
        the gradients this rank lacks, and every parameter gets the result (see [Note:
        unused parameters in a unit]).

        shared_input(dtype), when given, returns a SharedBuffer (or None) to lay this unit's
        reduce inputs of that dtype out in: the transport then reads them straight from every
        rank's buffer, with no staging copy (see [Note: reduce inputs in shared memory])."""
        size = self.group.size
        buffers, used = {}, {}
        for bucket in self.buckets:
            if bucket.c.reducing:
                raise RuntimeError("a unit's gradients were reduced twice in one backward")
            taken = [self._take_grad(p) for p in bucket.params]
            had = [grad is not None or unused for grad in taken]
            if not any(had):
                continue
            # One dtype for the layout (_chunk_cat takes no mix): the gradients' own (the
            # compute dtype), or the reduce dtype where they come in two (an accumulator
            # beside autograd's) or none came (unused).
            dtypes = {grad.dtype for grad in taken if grad is not None}
            common = dtypes.pop() if len(dtypes) == 1 else bucket.reduce_dtype
            offsets = self._reduce_layout(bucket, taken, all_reduce)
            grads = []
            for p, grad in zip(bucket.params, taken):
                if p not in offsets:
                    continue
                if grad is None:   # unused here: zeros in its place
                    grad = torch.zeros(p.shape, dtype=common, device=self.device)
                elif grad.dtype != common:
                    grad = grad.to(common)
                if p.piece > 0:
                    grads.append((p, grad))
            numel = sum(p.piece for p in offsets)
            bucket.reduce_offsets = offsets
            dtype = bucket.reduce_dtype
            code = dtype_code(dtype)
            # Averaged in the collective unless a division follows (_post_divide_factor).
            redop = REDOP_SUM if self._post_divide_factor(bucket) is not None or \
                not dtype.is_floating_point else REDOP_AVG
            after = None
            if self.replicate_group is not None and all_reduce and bucket.partial is None:
                after = (self.engine(self.replicate_group), code, redop,
                         self._replicate_stream())
            if self.comm_hook is not None:
                self._run_comm_hook(bucket, grads, had, code, redop)
                continue
            if self._reduces_in_place(bucket, grads, after):
                pieces = [grad.view(-1) for _, grad in grads]
                bucket.c.reduce(code, redop, None, pieces, numel, after)
                bucket.redop = redop
                bucket.reduce_output = pieces
                bucket.reduce_had_grad = had
                continue
            if shared_input is not None and dtype not in buffers:
                buffers[dtype], used[dtype] = shared_input(dtype), 0
            if buffers.get(dtype) is not None:
                source = torch.frombuffer(buffers[dtype], dtype=dtype, count=size * numel,
                                          offset=used[dtype]).view(size, numel)
                used[dtype] += size * numel * dtype.itemsize
            else:
                source = torch.empty((size, numel), dtype=dtype, device=self.device)
            _lay_out(grads, source, offsets)
            # The gradients are copied in: freed before the output is allocated (see [Note:
            # memory at the reduction] in _state.py).
            taken = grads = grad = None
            # Over one rank the input is the output, which the transport leaves in place.
            output = source.view(-1) if size == 1 else \
                torch.empty(numel, dtype=bucket.reduce_dtype, device=self.device)
            bucket.c.reduce(code, redop, source, output, numel, after)
            bucket.redop = redop
            bucket.reduce_output = output
            bucket.reduce_had_grad = had

    def _reduce_layout(self, bucket, taken, all_reduce):
        """[Note: frozen parameters in the reduction]
        {param: its offset in each rank's row of the reduce-scatter} for the parameters of
        bucket that the reduction moves.  A frozen parameter without a gradient is left out,
        as torch's fully_shard leaves it out: a frozen embedding or base model of a fine-tune
        would otherwise cost its bytes of zeros in every step's reduce-scatter.  Whether a
        parameter requires grad is the same on every rank, so the layout is too; a trainable
        one this rank did not use gets zeros in its place instead, because another rank may
        have used it.  Where reductions add up across backwards in their layout (HSDP's
        partial sums under set_requires_all_reduce(False)) and under FSDP1's communication
        hooks, which see the bucket's whole layout, every parameter is moved."""
        whole = self.comm_hook is not None or bucket.partial is not None or \
            (self.replicate_group is not None and not all_reduce)
        offsets, offset = {}, 0
        for p, grad in zip(bucket.params, taken):
            if whole or grad is not None or p.sharded.requires_grad:
                offsets[p] = p.offset if whole else offset
                offset += p.piece
        return offsets

    def _run_comm_hook(self, bucket, grads, had, code, redop):
        """FSDP1's communication hook reduces bucket's gradients, laid out as the reduce-
        scatter takes them, on the calling thread (see dptc/fsdp/_comm_hooks.py); the C unit
        then holds a reduction with nothing in flight."""
        size = self.group.size
        source = torch.empty((size, bucket.numel), dtype=bucket.reduce_dtype, device=self.device)
        _lay_out(grads, source, bucket.reduce_offsets)
        state, hook = self.comm_hook
        grad = source.view(-1)
        if size == 1:
            hook(state, grad)
            output = grad
        else:
            output = torch.empty(bucket.numel, dtype=bucket.reduce_dtype, device=self.device)
            hook(state, grad, output)
        bucket.c.reduce(code, redop, None, [], 0, None)
        bucket.redop = redop
        bucket.reduce_output = output
        bucket.reduce_had_grad = had
        bucket.hooked = True

    def _post_divide_factor(self, bucket):
        """What a reduced bucket is divided by after the collectives summed it (None: they
        averaged it, or it is not floating point)."""
        if self.divide_factor is not None:
            return self.divide_factor
        if self.force_sum and bucket.reduce_dtype.is_floating_point:
            replicas = self.replicate_group.size if self.replicate_group is not None else 1
            return float(self.group.size * replicas)
        return None

    def _run_all_reduce_hook(self, output):
        """set_all_reduce_hook's hook on a bucket's reduced gradients (this rank's shard, in
        the reduce dtype, after the replicas' all-reduce under HSDP, before any division by
        a factor), as torch's; on its CUDA stream where one was given."""
        hook, stream = self.all_reduce_hook
        if stream is None:
            hook(output)
            return
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            hook(output)
        current.wait_stream(stream)

    def _keep_low_precision(self, p, dtype):
        """FSDP1's keep_low_precision_grads: the sharded gradient, accumulated in the
        parameter's dtype, is left in the compute dtype (param_dtype) for the optimizer, as
        torch's FSDP1 leaves it.  A later backward accumulates into it in the parameter's
        dtype again (finish_reduce)."""
        grad = p.sharded.grad
        if grad.dtype != dtype:
            self._set_grad_local(p, grad._local_tensor.to(dtype))

    def _set_grad_local(self, p, local):
        """Makes p.sharded.grad hold `local` in its dtype, which may differ from the
        parameter's (see _retype)."""
        _retype(p.sharded.grad, self._dtensor(local, p), local)

    def _replicate_stream(self):
        return 1 if self.replicate_group.num_streams > 1 else 0

    def finish_reduce(self, all_reduce=True):
        """Waits for the reductions and accumulates them into the sharded gradients (HSDP
        with all_reduce False: into the bucket's partial sum instead)."""
        for bucket in self.buckets:
            if not bucket.c.wait_reduce():
                continue
            output, had = bucket.reduce_output, bucket.reduce_had_grad
            offsets = bucket.reduce_offsets
            bucket.reduce_output = bucket.reduce_had_grad = bucket.reduce_offsets = None
            if self.replicate_group is not None and not all_reduce:
                if bucket.partial is None:
                    bucket.partial, bucket.partial_had = output, had
                else:
                    bucket.partial.add_(output)
                    bucket.partial_had = [a or b for a, b in zip(bucket.partial_had, had)]
                continue
            if bucket.partial is not None:
                output.add_(bucket.partial)
                had = [a or b for a, b in zip(bucket.partial_had, had)]
                bucket.partial = bucket.partial_had = None
                with Range(f"dptc::all_reduce {self.label}"):
                    self.engine(self.replicate_group).run(
                        OP_ALL_REDUCE, dtype_code(output.dtype), bucket.redop, output, output,
                        output.numel(), 0, self._replicate_stream())
            if self.all_reduce_hook is not None:
                self._run_all_reduce_hook(output)
            # A list: the gradients themselves, reduced in place (_reduces_in_place).
            pieces = iter(output) if isinstance(output, list) else None
            # A communication hook divided as it chose.
            factor = None if bucket.hooked else self._post_divide_factor(bucket)
            bucket.hooked = False
            if factor is not None:
                for piece in output if pieces is not None else [output]:
                    piece.div_(factor)
            for p, has in zip(bucket.params, had):
                if p not in offsets:
                    continue
                piece = next(pieces) if pieces is not None and p.piece > 0 else None
                if not has or not p.sharded.requires_grad:
                    continue
                local = p.local_view(output, offsets[p]) if pieces is None else \
                    piece.view(p.local_shape)
                if local.dtype != p.orig_dtype:
                    local = local.to(p.orig_dtype)
                grad = p.sharded.grad
                if grad is None:
                    p.sharded.grad = _like_shard(local, p.sharded)
                elif grad.dtype != p.orig_dtype:     # kept in low precision last time
                    self._set_grad_local(p, grad._local_tensor.to(p.orig_dtype) + local)
                else:
                    grad._local_tensor.add_(local)
                if self.keep_low_precision_grads:
                    self._keep_low_precision(p, bucket.compute_dtype)
                self._run_post_accumulate_grad_hooks(p)

    def _run_post_accumulate_grad_hooks(self, p):
        """Hooks the user registered on a sharded parameter (register_post_accumulate_grad_hook:
        an optimizer stepped in backward), run once its reduced gradient is accumulated, as
        torch's fully_shard runs them.  Autograd never accumulates into the sharded
        parameter, so it would never run them; dptc's own hooks are on the unsharded one."""
        hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
        if hooks and p.sharded is not p.unsharded:
            for hook in list(hooks.values()):
                hook(p.sharded)
