"""dptc.DistributedDataParallel: a drop-in for torch.nn.parallel.DistributedDataParallel.

This file holds the public wrapper and its argument checks; the bucket policy and assignment
are in dptc/_buckets.py, and everything that happens per step (hooks, bucket launches, waits,
write-back) is in csrc/reducer.c.  Python decides the bucket assignment and allocates the
bucket tensors; C keeps references to them (see [Note: gradient bucket lifetime] in
reducer.c).
"""

import contextlib
import logging
import os
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from . import _C, _cuda
from ._compile import active_ddp_module, eager
from .comm_hooks import (COMM_BF16, COMM_FP16, COMM_PLAIN, COMM_PYTHON, GradBucket,
                         LaunchedBucket, builtin_mode, check_hook, hook_name, native_mode)
from ._buckets import BucketPolicy, assign_buckets, first_buckets
from ._dcp import recognise
from ._dtypes import dtype_code
from ._sparse import produces_sparse_gradient, reduce_sparse_gradients
from ._same_model import check_same_parameters
from .collectives import ReduceOp, all_reduce, broadcast
from .group import default_group, get_rank, resolve
from .join import DDPJoinHook, Join, Joinable, _JoinConfig, notify

__all__ = ["DistributedDataParallel", "DDP"]

logger = logging.getLogger("dptc")
_MB = 1024 * 1024
_DEBUG = os.environ.get("DPTC_DEBUG", "") not in ("", "0")


def _broadcast_coalesced(tensors, group, src=0, names=None):
    """Copies rank src's tensors to every rank: one broadcast per dtype, not one per tensor."""
    by_dtype = {}
    for k, tensor in enumerate(tensors):
        if tensor.numel():
            name = names[k] if names else "tensor"
            tensor = tensor.detach()
            if tensor.is_complex():   # as its real pairs
                tensor = torch.view_as_real(tensor)
            by_dtype.setdefault(tensor.dtype, []).append((tensor, name))
    with torch.no_grad():
        for dtype, entries in by_dtype.items():
            dtype_code(dtype, entries[0][1])
            numels = [tensor.numel() for tensor, _ in entries]
            if group.rank == src:
                flat = torch.cat([tensor.reshape(-1) for tensor, _ in entries])
            else:
                flat = torch.empty(sum(numels), dtype=dtype, device=entries[0][0].device)
            broadcast(flat, group_src=src, group=group)
            if group.rank != src:
                for (tensor, _), piece in zip(entries, flat.split(numels)):
                    tensor.copy_(piece.view_as(tensor))


def _qualified(prefix, name):
    return f"{prefix}.{name}" if prefix else name


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism over dptc's engine, with torch's DistributedDataParallel interface.

    Wrap a model that is replicated on every rank; gradients are averaged over the process
    group during backward, in buckets, overlapping communication with the rest of backward.
    Parameters and buffers are copied from rank 0 at construction (with ``init_sync``; the
    deprecated ``broadcast_buffers=False`` given alone leaves the buffers out, as in torch
    2.13), buffers again before each forward unless ``forward_sync_buffers`` (without it,
    ``broadcast_buffers``) is False.  A CPU module on a node with fewer than two cores per
    local rank has its buckets all-reduced at the end of backward instead, where the progress
    thread would only take cores from backward (see [Note: overlap] in csrc/reducer.c;
    ``DPTC_DDP_OVERLAP=1`` or ``0`` decides instead).

    Supported: CPU modules, and modules on one CUDA device (``device_ids`` None or that
    device's index; their buckets live on the device and go through NCCL, see [Note: buckets
    on a device] in csrc/reducer.c); ``bucket_cap_mb`` (0: a bucket per parameter after the
    first backward, as torch's); ``find_unused_parameters``; ``gradient_as_bucket_view``;
    ``forward_sync_buffers``/``broadcast_buffers``; ``static_graph`` (as torch's: the
    parameters unused in the first synced backward, and those a reentrant checkpoint reaches
    more than once, need no find_unused_parameters; see [Note: static graph] in
    csrc/reducer.c); ``no_sync()`` and ``require_backward_grad_sync``; ``register_comm_hook``
    (the all-reduce, fp16 and bf16 compression hooks natively, any other hook in Python on a
    CPU module; see dptc.comm_hooks); sparse gradients (``nn.Embedding``/``nn.EmbeddingBag``
    with sparse=True, on a CPU module), averaged as torch's (see dptc/_sparse.py).
    Complex parameters are averaged as their real pairs, as torch's.
    ``process_group`` may be any group dptc accepts (a dptc or torch group, a DeviceMesh
    dimension), or ``device_mesh`` a one-dimensional mesh.  ``join()`` (or torch's ``Join``)
    trains on uneven inputs, as torch's (see dptc/join.py).
    Not supported, with an error saying so:
    ``delay_all_reduce_named_params``/``param_to_hook_all_reduce``, ``mixed_precision`` (use
    torch.autocast), Python comm hooks on a CUDA module; with sparse gradients, comm hooks
    other than allreduce_hook and join().
    """

    # torch 2.13's parameters, in its order: positional calls bind as under torch.
    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                           mixed_precision, process_group, device_mesh)
        self.bucket_policy = BucketPolicy.create(bucket_cap_mb, bucket_cap_mb_list)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        forward_sync_buffers, init_sync_buffers = _buffer_sync(broadcast_buffers,
                                                               forward_sync_buffers)

        self.module = module
        group = device_mesh if device_mesh is not None else process_group
        self._group = resolve(group, "device_mesh" if device_mesh is not None
                              else "process_group")
        if device_mesh is not None:
            group = device_mesh.get_group()
        # What torch's DDP keeps as process_group; see the property.
        self._torch_group = group if isinstance(group, dist.ProcessGroup) else None
        if self._group is None:
            raise ValueError(f"this rank ({get_rank()}) is not a member of the process_group "
                             f"passed to DistributedDataParallel; only its members may wrap a "
                             f"module with it")
        self.dim = dim
        self.forward_sync_buffers = bool(forward_sync_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.bucket_bytes_cap = self.bucket_policy.bucket_bytes
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._assign_modules_buffers()

        (params, names), (sparse_params, sparse_names) = self._parameters_to_reduce()
        self.device = _check_devices(params + sparse_params, device_ids, output_device)
        if sparse_params and self.device.type != "cpu":
            raise NotImplementedError(
                f"parameter {sparse_names[0]!r} gets sparse gradients (its module has "
                f"sparse=True), which dptc's DistributedDataParallel reduces on CPU modules "
                f"only; give the module sparse=False on {self.device}")
        self.device_type = self.device.type
        if self.device_type == "cpu":
            for layer_name, layer in module.named_modules():
                if isinstance(layer, nn.SyncBatchNorm):
                    # torch's DDP refuses them too: their forward runs on accelerators only.
                    raise ValueError(
                        f"SyncBatchNorm layers only work with GPU modules: "
                        f"{layer_name or type(module).__name__!r} is a SyncBatchNorm on the CPU; "
                        f"use torch.nn.BatchNorm (statistics per rank) on CPU modules")
        cuda = self.device_type == "cuda"
        self.device_ids = [self.device.index] if cuda else None
        self.output_device = self.device_ids[0] if cuda else None
        codes = _reduced_codes(params, names)

        # See [Note: the same model on every rank] in dptc/_same_model.py.
        check_same_parameters(
            [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore],
            self._group, "DistributedDataParallel",
            "build the module identically on every rank (the same layers in the same order, "
            "shapes, dtypes and requires_grad) before wrapping it")
        if init_sync and self._group.size > 1:
            self._sync_module_states(broadcast_buffers=init_sync_buffers)
        self._build_reducer(params, names, sparse_params, sparse_names, codes)

    def _build_reducer(self, params, names, sparse_params, sparse_names, codes):
        """The per-step machinery over the parameters: the C reducer, its first buckets and
        hooks (at construction, and again after unpickling or copy.deepcopy)."""
        cuda = self.device_type == "cuda"
        self._params = params
        self._param_names = names
        self._sparse_params = sparse_params
        self._sparse_names = sparse_names
        self._comm_mode = COMM_PLAIN
        self._comm_hook = None
        self._comm_state = None
        self._buckets = None          # [(tensor, members, views)], in launch order
        self._assignment = None
        self._buckets_rebuilt = False
        # join(): see dptc/join.py.
        self._divide_by_initial_world_size = True
        self._join_works = []         # this rank's join all-reduces not yet waited for
        self._shadowed_sync = False   # a joined rank stood in for a synced backward
        # A CUDA module's buckets live on its device and go through the group's NCCL engine
        # (see [Note: buckets on a device] in csrc/reducer.c).
        engine = self._group.device_engine(self.device) if cuda else \
            self._group._c
        device = self.device
        device_kwargs = {}
        if cuda:
            device_kwargs["current_stream"] = lambda: torch.cuda.current_stream(device)
            # find_unused_parameters and static_graph (which _set_static_graph may set
            # later) all-reduce the used map on the device.
            self._used_map = self._bucket_tensor(len(params), torch.uint8)
            device_kwargs["stage_used_map"] = self._stage_used_map
        self._reducer = _C.Reducer(engine, params, names, codes,
                                   torch.autograd.Variable._execution_engine.queue_callback,
                                   self.find_unused_parameters, self.gradient_as_bucket_view,
                                   static_graph=self.static_graph,
                                   after_step=self._reduce_sparse if sparse_params else None,
                                   **device_kwargs)
        self._reducer.overlap = _overlaps(cuda, self._group)
        # See [Note: bucket launch order] in csrc/reducer.c.
        self._install_buckets(first_buckets(
            self._param_bytes(), [p.dtype for p in params],
            self.bucket_policy.first_backward(self.find_unused_parameters, self.static_graph)))
        self._reducer.register_hooks()
        # Held weakly by the hooks; they leave the parameters with the wrapper, as the C
        # reducer's do.
        handles = [p.register_post_accumulate_grad_hook(_note_sparse(self))
                   for p in sparse_params]
        weakref.finalize(self, _remove_hooks, handles)

        total = sum(self._param_bytes())
        logger.info("Applied DistributedDataParallel to %s: %d parameters, %.2f MiB of "
                    "gradients in %d buckets (cap %.2f MiB, first %.2f MiB), world size %d, "
                    "find_unused_parameters=%s, gradient_as_bucket_view=%s, buckets launched "
                    "%s",
                    type(self.module).__name__, len(params), total / _MB, len(self._buckets),
                    self.bucket_policy.bucket_bytes / _MB,
                    self.bucket_policy.first_bucket_bytes / _MB, self._group.size,
                    self.find_unused_parameters, self.gradient_as_bucket_view,
                    "during backward" if self._reducer.overlap else "at its end")

    # Pickling and copy.deepcopy, as torch's: over the default group only; the copy gets a
    # reducer of its own, with the first buckets and no comm hook, over the default group.
    _UNPICKLED = ("_group", "_torch_group", "_reducer", "_buckets", "_assignment", "_used_map",
                  "_join_works", "_params", "_param_names", "_sparse_params", "_sparse_names")

    def __getstate__(self):
        if self._group is not default_group():
            raise RuntimeError("DistributedDataParallel can be pickled or deep-copied only over "
                               "the default process group, as torch's; this one wraps its "
                               "module over a group of its own")
        state = dict(self.__dict__)
        for name in self._UNPICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._group = default_group()
        self._torch_group = None
        (params, names), (sparse_params, sparse_names) = self._parameters_to_reduce()
        codes = _reduced_codes(params, names)
        self._build_reducer(params, names, sparse_params, sparse_names, codes)
        self._assign_modules_buffers()

    @property
    def process_group(self):
        """torch's: the torch.distributed group the gradients are averaged over, as the
        process_group (or device_mesh's group) given, else the default group; scripts hand it
        to torch's comm hook states and collectives (PowerSGDState(process_group=...),
        group.size()).  A group made by dptc.new_group has no torch group and is itself."""
        return self._torch_group or self._group.torch_group or self._group

    @property
    def broadcast_buffers(self):
        """torch's older name of forward_sync_buffers."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    # -- construction helpers ------------------------------------------------------------------

    def _parameters_to_reduce(self):
        """Parameters that require grad, deduplicated by identity (tied weights once), as
        (params, names) for the C reducer and (params, names) of those that get sparse
        gradients (see [Note: sparse gradients] in dptc/_sparse.py)."""
        params, names, seen = [], [], set()
        sparse_params, sparse_names = [], []
        for module_name, submodule in self.module.named_modules():
            for param_name, param in submodule.named_parameters(recurse=False):
                name = _qualified(module_name, param_name)
                if not param.requires_grad or name in self.parameters_to_ignore:
                    continue
                if isinstance(param, nn.parameter.UninitializedParameter):
                    raise RuntimeError(
                        "Modules with uninitialized parameters can't be used with "
                        "`DistributedDataParallel`. Run a dummy forward pass to correctly "
                        f"initialize the modules (parameter {name!r} is uninitialized)")
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if produces_sparse_gradient(submodule):
                    sparse_params.append(param)
                    sparse_names.append(name)
                else:
                    params.append(param)
                    names.append(name)
        if not params and not sparse_params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't "
                               "have any parameter that requires a gradient.")
        return (params, names), (sparse_params, sparse_names)

    def _named_buffers(self):
        return [(name, buffer) for name, buffer in self.module.named_buffers()
                if name not in self.parameters_to_ignore]

    def _assign_modules_buffers(self):
        """The buffers forward syncs, as torch's DDP keeps them: found at construction, and
        found again before each sync (a module may reassign its buffers).  A module with no
        buffers when wrapped is not walked again at each forward."""
        named = self._named_buffers()
        self.modules_buffers = [buffer for _, buffer in named]
        self.named_module_buffers = dict(named)

    def _sync_module_states(self, broadcast_buffers, src=0):
        states = [(name, p) for name, p in self.module.named_parameters()
                  if name not in self.parameters_to_ignore]
        if broadcast_buffers:
            states += self._named_buffers()
        _broadcast_coalesced([t for _, t in states], self._group, src=src,
                             names=[f"parameter or buffer {n!r}" for n, _ in states])

    def _param_bytes(self):
        return [p.numel() * p.element_size() for p in self._params]

    def _install_buckets(self, assignment):
        """Allocates buckets for `assignment` (lists of parameter indices, in launch order) and
        hands them to the reducer (no-op if unchanged)."""
        if assignment == self._assignment:
            return False
        buckets = []
        for members in assignment:
            # A complex bucket is kept and reduced as real pairs, its views complex.
            dtype = self._params[members[0]].dtype
            pairs = 2 if dtype.is_complex else 1
            tensor = self._bucket_tensor(sum(self._params[i].numel() * pairs for i in members),
                                         dtype.to_real())
            views, offset = [], 0
            for i in members:
                numel = self._params[i].numel() * pairs
                view = tensor[offset:offset + numel]
                views.append((view.view(dtype) if pairs == 2 else view).view(
                    self._params[i].shape))
                offset += numel
            buckets.append((tensor, members, views))
        self._buckets = buckets
        self._assignment = assignment
        self._push_buckets()
        if self.gradient_as_bucket_view:
            self._point_grads_at_buckets()
        if _DEBUG:
            for k, (tensor, members, _) in enumerate(buckets):
                logger.debug("DDP bucket %d: %s x %d (%d bytes): %s", k, tensor.dtype,
                             tensor.numel(), tensor.numel() * tensor.element_size(),
                             ", ".join(self._param_names[i] for i in members))
        return True

    def _bucket_tensor(self, numel, dtype):
        if self.device_type == "cuda":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        # Shared with the local peers: the all-reduce needs no staging copies.
        return self._group.empty_shared(numel, dtype)

    def _stage_used_map(self, flags):
        """A CUDA module's used-parameter map (`flags`, one byte per parameter) copied into
        device memory on the current stream, for the reducer to all-reduce there (see [Note:
        unused parameters on a device] in csrc/reducer.c).  The host bytes are pinned, so the
        copy does not wait for the stream; torch's pinned-memory cache keeps them until the
        copy is done."""
        host = torch.frombuffer(bytearray(flags), dtype=torch.uint8)
        if torch.cuda.is_available():
            host = host.pin_memory()
        self._used_map.copy_(host, non_blocking=True)
        return self._used_map

    def _push_buckets(self):
        compress = {COMM_FP16: torch.float16,
                    COMM_BF16: torch.bfloat16}.get(self._comm_mode)
        entries = []
        for tensor, members, views in self._buckets:
            comm, comm_code = None, None
            if compress is not None and tensor.dtype in (torch.float32, torch.float64):
                comm = self._bucket_tensor(tensor.numel(), compress)
                comm_code = dtype_code(compress)
            entries.append((tensor, dtype_code(tensor.dtype), list(members), list(views),
                            comm, comm_code))
        self._comm_buffers = [entry[4] for entry in entries]
        launcher = self._launch_hook if self._comm_mode == COMM_PYTHON else None
        self._reducer.set_buckets(entries, self._comm_mode, launcher)

    def _launch_hook(self, k, tensor=None):
        """Runs the Python comm hook on bucket k (called by the reducer when it launches the
        bucket; see [Note: Python comm hooks] in csrc/reducer.c), over `tensor` instead of the
        bucket's own when given."""
        own, members, _ = self._buckets[k]
        tensor = own if tensor is None else tensor
        bucket = GradBucket(k, len(self._buckets), tensor, [self._params[i] for i in members])
        future = self._comm_hook(self._comm_state, bucket)
        if not isinstance(future, torch._C.Future):
            raise TypeError(f"communication hook {hook_name(self._comm_hook)} returned "
                            f"{type(future).__name__}; a hook returns a torch.futures.Future "
                            f"holding the bucket's new gradients (for a hook that does not "
                            f"communicate, a Future completed with set_result)")
        return LaunchedBucket(future, tensor, self._comm_hook, k, self._group)

    def _point_grads_at_buckets(self):
        """gradient_as_bucket_view: existing grads move into the buckets and become views."""
        with torch.no_grad():
            for _, members, views in self._buckets:
                for i, view in zip(members, views):
                    param = self._params[i]
                    if param.grad is not None and param.grad is not view:
                        view.copy_(param.grad)
                        param.grad = view

    def _rebuild_buckets(self):
        """Once, after the first synced backward: buckets follow rank 0's observed order.

        See [Note: bucket launch order] in csrc/reducer.c.  As in torch, not with
        find_unused_parameters (unless static_graph), where the order may change per step.
        """
        if self._buckets_rebuilt or (self.find_unused_parameters and not self.static_graph):
            return
        observed = self._reducer.observed_order
        if observed is None and not self._shadowed_sync:
            return
        # A rank that joined before its first backward has no order of its own.
        observed = observed or []
        self._buckets_rebuilt = True
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        if self._group.size > 1:
            shared = torch.tensor(order, dtype=torch.int64)
            broadcast(shared, group_src=0, group=self._group)
            order = shared.tolist()
        assignment = assign_buckets(self._param_bytes(), [p.dtype for p in self._params],
                                    order, self.bucket_policy)
        if self._install_buckets(assignment):
            logger.info("DistributedDataParallel buckets rebuilt from the first backward's "
                        "order: %d buckets", len(self._buckets))

    # -- per step --------------------------------------------------------------------------

    def will_sync_module_buffers(self):
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and len(self.modules_buffers) > 0)

    def _sync_buffers(self, src=0):
        self._assign_modules_buffers()
        named = list(self.named_module_buffers.items())
        buffers = self.modules_buffers
        preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
        context = preserve(tuple(buffers)) if preserve else contextlib.nullcontext()
        with context:
            _broadcast_coalesced(buffers, self._group, src=src,
                                 names=[f"buffer {n!r}" for n, _ in named])

    def forward(self, *inputs, **kwargs):
        sync = self._pre_forward()
        with active_ddp_module(self):  # see [Note: torch.compile] in dptc/_compile.py
            output = self.module(*inputs, **kwargs)
        if self.require_forward_param_sync is not sync:  # nn.Module's __setattr__ is slow
            self.require_forward_param_sync = sync
        if sync and not torch.compiler.is_compiling():
            self._expect_backward(output)
        return output

    def _expect_backward(self, output):
        """Has the backward through ``output`` queue the reducer's end-of-backward callback
        on itself, the outermost backward (see [Note: where finalize runs] in
        csrc/reducer.c): a pre-hook on the grad_fn of every output tensor."""
        expect = self._reducer._expect_finalize
        leaves = (output,) if isinstance(output, torch.Tensor) else pytree.tree_leaves(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                leaf.grad_fn.register_prehook(expect)

    @eager
    def _pre_forward(self):
        """Everything forward does before the module runs; returns whether its backward
        syncs."""
        self._wait_join_works()
        grad_enabled = torch.is_grad_enabled()
        joining = self._join_config.enable
        # The collectives of a training rank under join(), in the order a joined rank's
        # _shadow_step issues them (see dptc/join.py).
        notified = notify(self, self._group)
        if grad_enabled or joining:
            self._rebuild_buckets()
        if self._group.size > 1 and self.will_sync_module_buffers():
            # Under join() rank 0 may have joined: the buffers of the last rank still
            # training win, as in torch.
            self._sync_buffers(self._find_common_rank(True) if joining else 0)
        sync = grad_enabled and self.require_backward_grad_sync
        if joining:
            # Whether this backward syncs; torch sends require_backward_grad_sync alone,
            # which makes a joined rank wait for the buckets of a no-grad forward.  Blocking,
            # as the notification (see dptc/join.py, notify).
            all_reduce(torch.full((1,), float(sync)), group=self._group)
        scale = 1.0
        if notified is not None:
            work, training = notified
            effective = sync and not self._divide_by_initial_world_size
            if work is not None:
                if effective:
                    work.wait()
                else:
                    self._join_works.append(work)
            if effective:
                scale = self._group.size / training.item()  # [Note: a step's scale]
        if grad_enabled:
            # A forward under no_grad has no backward: it leaves the reducer to the
            # backward an earlier forward prepared, as torch's does.
            self._reducer.prepare_for_backward(sync, scale)
        return sync

    # -- uneven inputs (see dptc/join.py) --------------------------------------------------

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """A context manager for training on uneven inputs, as torch's DDP.join(): a rank
        that runs out of inputs stands in for the others' collectives until every rank has
        run out, then every rank takes the model of the last.  Gradients are divided by the
        group's size (``divide_by_initial_world_size``) or by the number of ranks still
        training; ``throw_on_early_termination`` raises RuntimeError on every rank instead, at
        the first step some rank lacks.  Its counting goes over dptc's engine."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        if self._sparse_params:
            raise NotImplementedError(
                f"join() with sparse gradients (parameter {self._sparse_names[0]!r}, of a "
                f"module with sparse=True) is not implemented by dptc's "
                f"DistributedDataParallel; give the module sparse=False, or give every rank "
                f"the same number of inputs")
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        """The torch group over this DDP's ranks, for torch's Join, when there is one; else
        the dptc group."""
        return self._group.torch_group or self._group

    def _dptc_join_group(self):
        return self._group

    def _wait_join_works(self):
        if not self._join_works:  # every step outside join(): no attribute set
            return
        works, self._join_works = self._join_works, []
        for work in works:
            work.wait()

    def _find_common_rank(self, candidate):
        """The largest group rank among the ranks where `candidate` holds."""
        rank = torch.tensor([self._group.rank if candidate else -1])
        all_reduce(rank, op=ReduceOp.MAX, group=self._group)
        if rank.item() < 0:
            raise RuntimeError("DistributedDataParallel join: no rank qualified as the "
                               "authoritative copy of the model")
        return int(rank.item())

    def _shadow_step(self):
        """One step of a joined rank: the collectives forward and backward issue on the
        ranks still training (see forward), with zeros for gradients."""
        self._wait_join_works()
        self._rebuild_buckets()
        if self._group.size > 1 and self.will_sync_module_buffers():
            self._sync_buffers(self._find_common_rank(False))
        flag = torch.zeros(1)
        all_reduce(flag, group=self._group)
        sync = flag.item() != 0
        self.require_forward_param_sync = sync
        if not sync:
            return
        self._shadow_buckets()
        if self.find_unused_parameters:
            used = torch.zeros(len(self._params), dtype=torch.uint8, device=self.device)
            all_reduce(used, op=ReduceOp.MAX, group=self._group)
        self._shadowed_sync = True

    def _shadow_buckets(self):
        """Every bucket's reduction, in launch order, over zeros: what the reducer submits
        (csrc/reducer.c, bucket_launch), or the Python hook on a bucket of zeros."""
        for k, (tensor, _, _) in enumerate(self._buckets):
            if tensor.numel() == 0:
                continue
            if self._comm_mode == COMM_PYTHON:
                self._launch_hook(k, torch.zeros_like(tensor)).finish()
                continue
            operand, saved = self._shadow_operand(k)
            all_reduce(operand, op=ReduceOp.AVG, group=self._group)
            if saved is not None:
                with torch.no_grad():
                    operand.copy_(saved)

    def _shadow_operand(self, k):
        """(zeros to all-reduce for bucket k, what to restore in them afterwards or None).

        A CPU bucket is all-reduced where it lies, in shared memory, unless the training
        ranks reduce it over their gradients in place (csrc/reducer.c, [Note: gradients in
        place]: the members whose gradients are contiguous, as a contiguous parameter's
        are); the shared memory engine's algorithm follows that choice, so the zeros must lie
        where the training ranks' operand does: in the same shared buffer, or elsewhere.
        """
        tensor, members, _ = self._buckets[k]
        comm = self._comm_buffers[k]
        if tensor.is_cuda:
            return torch.zeros_like(comm if comm is not None else tensor), None
        if comm is not None:
            return comm.zero_(), None
        if self._reducer.in_place and any(self._params[i].numel() and
                                          self._params[i].is_contiguous() for i in members):
            return torch.zeros_like(tensor), None
        saved = tensor.clone()
        return tensor.zero_(), saved

    def _sync_final_model(self, is_last_joiner):
        """After join: every rank takes the parameters (and buffers) of the last rank to
        join, the largest such rank."""
        self._wait_join_works()
        self._authoritative_rank = self._find_common_rank(is_last_joiner)
        if self._group.size > 1:
            self._sync_module_states(self.forward_sync_buffers, src=self._authoritative_rank)
        # Every rank is here, at the end of the context: forward stops notifying, together.
        # (torch's DDP goes on notifying after its join context, so a forward that only some
        # ranks run there waits for the others.)
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @contextlib.contextmanager
    def no_sync(self):
        """Disables gradient averaging inside the context: grads accumulate locally and are
        averaged by the first synced backward after it.  Run forward inside the context."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state, hook):
        """Chooses how buckets are communicated, as torch's register_comm_hook.

        Run natively (no Python per bucket): dptc.comm_hooks.allreduce_hook,
        fp16_compress_hook and bf16_compress_hook, and torch's default_hooks functions of the
        same names; state must then be None or the DDP's process group.  Any other hook runs
        in Python on a CPU module: ``hook(state, bucket)`` gets a dptc.comm_hooks.GradBucket
        once the bucket is full and returns a torch.futures.Future of its new gradients (see
        dptc.comm_hooks).  Register once, before the first backward.
        """
        check_hook(hook)
        mode = native_mode(hook)
        if mode is None:
            if self.device_type == "cuda":
                raise NotImplementedError(
                    f"register_comm_hook: the Python hook {hook_name(hook)} runs on CPU "
                    f"modules only in dptc; a CUDA module takes allreduce_hook, "
                    f"fp16_compress_hook or bf16_compress_hook (from dptc.comm_hooks or "
                    f"torch's default_hooks)")
            mode = COMM_PYTHON
        elif state is not None and resolve(state, "state") is not self._group:
            raise ValueError(f"register_comm_hook: state must be None or the process group "
                             f"this DistributedDataParallel reduces over, got {state!r}")
        self._set_comm(mode, hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type):
        """torch's built-in hooks by type: ALLREDUCE and FP16_COMPRESS, both run natively."""
        self._set_comm(builtin_mode(comm_hook_type), comm_hook_type, None)

    def _set_comm(self, mode, hook, state):
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        if self._reducer.state == "reducing":
            raise RuntimeError("register_comm_hook: a communication hook cannot be registered "
                               "during a backward pass; register it before the first one")
        if self._sparse_params and mode != COMM_PLAIN:
            raise NotImplementedError(
                f"register_comm_hook: {hook_name(hook)} with sparse gradients (parameter "
                f"{self._sparse_names[0]!r}, of a module with sparse=True) is not implemented "
                f"by dptc's DistributedDataParallel; give the module sparse=False, or use "
                f"allreduce_hook")
        self._comm_hook = hook
        self._comm_state = state
        if mode != self._comm_mode or mode == COMM_PYTHON:
            self._comm_mode = mode
            self._push_buckets()
        logger.info("DistributedDataParallel communication hook: %s (%s)", hook_name(hook),
                    "in Python" if mode == COMM_PYTHON else "native")

    # torch's, which marks the names on the module: module._ddp_params_and_buffers_to_ignore,
    # which __init__ reads.
    _set_params_and_buffers_to_ignore_for_model = staticmethod(
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)

    def _set_static_graph(self):
        """Older spelling of static_graph=True, before the first synced step."""
        if self.static_graph:
            return
        self._reducer.static_graph = True
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, so "
                          "you do not need to set find_unused_parameters=true, just be sure "
                          "these unused parameters will not change during training loop while "
                          "calling `_set_static_graph`.", stacklevel=2)

    def _get_ddp_logging_data(self):
        """torch's DDP logging fields that describe the wrapper: its configuration, the
        parameters and buckets, and how many synced backward passes it reduced (torch's
        sampled timings are not measured).  The backend is "dptc"."""
        params = self._params + self._sparse_params
        dtypes = sorted({_C10_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})
        return {
            "module_name": type(self.module).__name__,
            "world_size": self._group.size,
            "rank": self._group.rank,
            "backend_name": "dptc",
            "device_ids": ", ".join(str(d) for d in self.device_ids or ()),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "is_multi_device_module": 0,
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm)
                                   for m in self.module.modules())),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(dtypes),
            "bucket_sizes": ", ".join(str(tensor.numel() * tensor.element_size())
                                      for tensor, _, _ in self._buckets),
            "has_rebuilt_buckets": int(self._buckets_rebuilt),
            "iteration": self._reducer.stats["steps"],
        }

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate):
        """torch's: how often its DDP samples runtime timings.  Validated as torch validates
        it; dptc measures no per-iteration timings for the logging data."""
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater "
                             "than 1")

    def _reduce_sparse(self):
        """The reducer's after_step: see [Note: sparse gradients] in dptc/_sparse.py."""
        reduce_sparse_gradients(self._sparse_params, self._sparse_names, self._group)

    def _reducer_stats(self):
        """Counters of the C reducer: steps, buckets, launches during/after backward, wait s."""
        return self._reducer.stats


def _reduced_codes(params, names):
    """The dtype codes the reducer averages each parameter in: a complex parameter's real
    dtype (its gradient is averaged as real pairs, as torch's DDP averages it)."""
    return [dtype_code(p.dtype.to_real(), f"parameter {name!r}")
            for p, name in zip(params, names)]


# The names torch's DDP logging data gives dtypes (c10's).
_C10_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                    torch.bfloat16: "c10::BFloat16"}


def _note_sparse(ddp):
    """The hook of a parameter with sparse gradients: tells ddp's reducer (held weakly, so
    that the parameter does not keep the wrapper alive)."""
    ref = weakref.ref(ddp)

    def hook(param):
        ddp = ref()
        if ddp is not None:
            ddp._reducer._note_sparse_gradient()
    return hook


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


def _buffer_sync(broadcast_buffers, forward_sync_buffers):
    """(forward_sync_buffers, init_sync_buffers), as torch 2.13 reads its arguments: buffers
    are broadcast at construction (with init_sync) unless the deprecated
    broadcast_buffers=False alone says otherwise; forward_sync_buffers, when given, decides
    the per-forward broadcast and broadcast_buffers is ignored.  The warnings are torch's."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still syncs buffers at init. If you "
                          "rely on buffers NOT being synced at init (e.g. rank-local buffers), "
                          "keep using `broadcast_buffers=False` until `init_sync_buffers` is "
                          "available.", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _check_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                       mixed_precision, process_group, device_mesh):
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be "
                         "set at the same time.")
    if delay_all_reduce_named_params is not None:
        raise NotImplementedError(
            "delay_all_reduce_named_params/param_to_hook_all_reduce are not supported by dptc's "
            "DistributedDataParallel; leave them None (every parameter is then reduced in "
            "buckets during backward)")
    if mixed_precision is not None:
        raise NotImplementedError(
            "mixed_precision is not supported by dptc's DistributedDataParallel; train under "
            "torch.autocast instead (the gradients stay in the parameters' dtype)")
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None and not hasattr(device_mesh, "get_group"):
        raise TypeError(f"device_mesh must be a torch DeviceMesh, got "
                        f"{type(device_mesh).__name__}")
    if device_mesh is not None and device_mesh.ndim != 1:
        raise ValueError(f"device_mesh must be one-dimensional for DistributedDataParallel, "
                         f"got {device_mesh.ndim} dimensions; pass mesh[dim_name] instead")


def _overlaps(cuda, group):
    """Whether the reducer launches buckets during backward (see [Note: overlap] in
    csrc/reducer.c): always on CUDA; on CPU only where this node has at least two cores per
    local rank, one for its backward and one for its progress thread.  DPTC_DDP_OVERLAP=1 or 0
    decides instead."""
    text = os.environ.get("DPTC_DDP_OVERLAP", "auto")
    if text not in ("auto", "0", "1"):
        raise ValueError(f"DPTC_DDP_OVERLAP must be auto, 0 or 1, got {text!r}")
    if text != "auto":
        return text == "1"
    if cuda:
        return True
    local_ranks = max(group.local_size, default_group().local_size)
    return len(os.sched_getaffinity(0)) >= 2 * local_ranks


def _check_devices(params, device_ids, output_device):
    """The module's one device: the CPU, or one CUDA device (its gradients then go through
    NCCL, loaded here first: dptc.CudaLibraryError names what is missing)."""
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"device_ids must be None or a list holding the module's one CUDA "
                        f"device (device_ids=[index]), got {device_ids!r}")
    devices = {p.device for p in params}
    device = params[0].device
    if len(devices) > 1 or device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"dptc's DistributedDataParallel takes a module on the CPU or on one CUDA device, "
            f"but its parameters are on {sorted(str(d) for d in devices)}; move the module "
            f"with .to(device)")
    if device.type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                f"GPU modules; for a CPU module leave them None, but got device_ids "
                f"{device_ids}, output_device {output_device}")
        return device
    _cuda.load()
    wanted = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
              for d in (device_ids or [])]
    if device_ids is not None and wanted != [device]:
        raise ValueError(f"device_ids must be None or [{device.index}], the device of the "
                         f"module's parameters ({device}), as torch's DistributedDataParallel "
                         f"takes for a single-device module; got {device_ids}")
    return device


DDP = DistributedDataParallel
# See [Note: wrappers in torch.distributed.checkpoint] in dptc/_dcp.py.
recognise(DistributedDataParallel, "DDP")
