"""FullyShardedDataParallel: torch 2.13's FSDP1 API on dptc's fully_shard core.

Each FullyShardedDataParallel instance wraps one module (``_fsdp_wrapped_module``, as torch's)
and applies ``fully_shard`` to it: the units, their C state machines and the collectives are
fully_shard's, not a second implementation.  ``auto_wrap_policy`` wraps the modules it selects
in nested instances first, children before parents, as torch's auto-wrapping does.  The
configuration classes are torch's own (``torch.distributed.fsdp``), so a script's enums and
configs compare equal.

Parameters keep their names as FSDP1 users see them: state-dict keys drop the
``_fsdp_wrapped_module.`` prefixes, and ``named_parameters()`` drops them inside
``summon_full_params`` (as torch's, with ``use_orig_params=True``).  There is no flat parameter:
every parameter is a DTensor shard, as under fully_shard.
"""

import collections
import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig,
                                    FullStateDictConfig, MixedPrecision, ShardedStateDictConfig,
                                    ShardingStrategy, StateDictType)
from torch.distributed.tensor import DTensor

from .._dcp import recognise
from .._same_model import check_same_parameters
from .. import group as _group_module
from ..collectives import all_reduce
from ..group import default_group
from ._api import MixedPrecisionPolicy
from ._comm_hooks import resolve as resolve_comm_hook
from ._fsdp1_state_dict import StateDicts, clean, original_names
from ._fully_shard import FSDPModule, _mesh_groups, copy_as_object, fully_shard
from ._wrap import _Policy, policy_targets

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "CPUOffload", "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _mesh_for(strategy, process_group, device_mesh, device_type):
    """The DeviceMesh fully_shard gets, from FSDP1's arguments as torch reads them: 1-D over
    the shard group for FULL_SHARD and SHARD_GRAD_OP; (replicate, shard) for the hybrid
    strategies (by default replicate across nodes and shard within one; or the pair
    ``process_group=(shard, replicate)``) and for NO_SHARD (replicate over the group, shards
    of one rank)."""
    default_group()                    # torch.distributed too, from torchrun's environment
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass process_group or device_mesh to FullyShardedDataParallel, "
                         "not both")
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        if strategy in _HYBRID and device_mesh.ndim != 2:
            raise ValueError(f"{strategy} needs a 2-D device_mesh (replicate, shard), got "
                             f"{device_mesh.ndim} dims")
        if strategy == ShardingStrategy.NO_SHARD and device_mesh.ndim == 1:
            return _replicated(device_mesh.get_group(0), device_mesh.device_type)
        return device_mesh
    if strategy in _HYBRID:
        if process_group is None:
            counts = collections.Counter(_group_module._world_nodes)
            if len(set(counts.values())) != 1:
                raise ValueError(
                    f"{strategy} without process_group shards within a node and replicates "
                    f"across nodes, which needs as many ranks on every node; the nodes hold "
                    f"{[counts[n] for n in sorted(counts)]} ranks.  Launch the same "
                    f"--nproc-per-node on every node, or pass process_group=(shard group, "
                    f"replicate group) or a 2-D device_mesh")
            local = counts[0]
            world = dist.get_world_size()
            return init_device_mesh(device_type, (world // local, local),
                                    mesh_dim_names=("replicate", "shard"))
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(f"{strategy} takes process_group=None or a pair (shard group, "
                             f"replicate group), got {type(process_group).__name__}")
        return _hybrid_mesh(*process_group, device_type)
    if isinstance(process_group, tuple):
        raise ValueError(f"process_group as a pair (shard, replicate) is for HYBRID_SHARD; "
                         f"{strategy} takes one group")
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be None or a torch.distributed ProcessGroup "
                        f"(torch.distributed.new_group, or mesh.get_group()), or pass "
                        f"device_mesh=; got {type(process_group).__name__} {process_group!r}")
    if strategy == ShardingStrategy.NO_SHARD:
        return _replicated(group, device_type)
    return DeviceMesh.from_group(group, device_type)


def _hybrid_mesh(shard, replicate, device_type):
    """The (replicate, shard) mesh of the pair: row i is the shard group of the i-th member
    of this rank's replicate group.  Every rank tells the others its shard group (the
    constructor is collective, as torch's)."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(shard))
    layout = [rows[rank] for rank in dist.get_process_group_ranks(replicate)]
    if len({len(row) for row in layout}) != 1:
        raise ValueError(f"process_group=(shard, replicate): the shard groups of the replicate "
                         f"group's members differ in size ({layout}); every shard group must "
                         f"have as many ranks")
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def _replicated(group, device_type):
    """NO_SHARD over group: a (replicate, shard) mesh whose shard groups hold one rank each.
    Every rank makes the single-rank groups, in rank order (new_group is collective)."""
    singles = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group([group, singles[dist.get_rank()]], device_type,
                                 mesh=[[rank] for rank in ranks],
                                 mesh_dim_names=("replicate", "shard"))


def _device_of(module, device_id):
    """The device the instance shards on: device_id's (an int is a CUDA index, as torch
    reads it), else that of the module's first non-meta parameter, else the CPU."""
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else \
            torch.device(device_id)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device_id={device_id!r}: dptc's FullyShardedDataParallel shards "
                             f"on the CPU or a CUDA device")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device_id={device_id!r} names a CUDA device, but this torch sees "
                             f"none (torch {torch.__version__}); pass device_id=None or 'cpu' "
                             f"to shard on the CPU")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    for param in module.parameters():
        if not param.is_meta:
            return param.device
    return torch.device("cpu")


def _set_prefetch(state, backward_prefetch, forward_prefetch):
    """FSDP1's prefetch options on a unit's State: forward_prefetch=False gathers each unit in
    its own pre-forward; backward_prefetch BACKWARD_PRE (the default) starts gathering the next
    unit of backward in this one's pre-backward, BACKWARD_POST in its post-backward, None
    never.  limit_all_gathers needs nothing: a unit prefetches at most one other, so at most
    two units' gathers are ever outstanding."""
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got "
                        f"{backward_prefetch!r}")
    if not forward_prefetch:
        state.forward_prefetch = []
    if backward_prefetch is None:
        state.backward_prefetch = []
    state.prefetch_after_backward = backward_prefetch == BackwardPrefetch.BACKWARD_POST


# [Note: an optimizer built before wrapping]
# fully_shard replaces each parameter it shards with a new DTensor parameter.  An optimizer
# made from model.parameters() before FullyShardedDataParallel wrapped the model holds the
# replaced ones, which never get a gradient again: its step() changes nothing, silently
# (torch 2.13's FSDP1, whose flat parameters take over the originals' memory, dies with
# SIGSEGV there on CPU).  So the replaced parameters are marked with their names, and an
# optimizer's first step() (again after add_param_group) raises if it holds any.

_REPLACED = "_dptc_replaced_by_fsdp"
_step_check = None


def _mark_replaced(originals, module):
    """Marks the parameters of `originals` (named_parameters() before fully_shard) that
    module no longer holds, and registers the optimizer check once per process."""
    global _step_check
    kept = {id(param) for param in module.parameters()}
    for name, param in originals:
        if id(param) not in kept:
            setattr(param, _REPLACED, clean(name))
    if _step_check is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _step_check = register_optimizer_step_pre_hook(
            _refuse_replaced_parameters)


def _refuse_replaced_parameters(optimizer, args, kwargs):
    checked = optimizer.__dict__.get("_dptc_checked_groups")
    if checked == len(optimizer.param_groups):
        return
    stale = [getattr(param, _REPLACED) for group in optimizer.param_groups
             for param in group["params"] if hasattr(param, _REPLACED)]
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): the optimizer holds {len(stale)} parameters "
            f"that FullyShardedDataParallel replaced with sharded ones when it wrapped the "
            f"model ({shown}); they get no gradients, so the step would not train the model. "
            f"Construct the optimizer after wrapping, from the wrapped model: "
            f"{type(optimizer).__name__}(model.parameters(), ...) with model the "
            f"FullyShardedDataParallel instance")
    optimizer.__dict__["_dptc_checked_groups"] = len(optimizer.param_groups)


def _policy_of(mixed_precision, root):
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    cast = mixed_precision.cast_root_forward_inputs if root else \
        mixed_precision.cast_forward_inputs
    return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                reduce_dtype=mixed_precision.reduce_dtype,
                                cast_forward_inputs=bool(cast))


def _exempt_from_mixed_precision(module, policy, classes):
    """torch's FSDP1 given an auto_wrap_policy and a MixedPrecision: every module of
    MixedPrecision's _module_classes_to_ignore (BatchNorm's, by default) becomes an instance of
    its own without mixed precision, its floating-point inputs cast to float32 and its outputs
    back (torch's own hooks, which also mark the module's _wrap_overrides), with torch's
    warning.  Returns the policy that chooses them too, as torch's: or'ed with wrapping those
    classes for a policy function; for a policy object the caller adds the modules marked."""
    from torch.distributed.fsdp._common_utils import _override_module_mixed_precision
    from torch.distributed.fsdp._wrap_utils import _warn_on_overridden_mixed_precision
    from torch.distributed.fsdp.wrap import _or_policy, _wrap_module_cls_individually
    overridden = _override_module_mixed_precision(module, classes)
    _warn_on_overridden_mixed_precision(overridden)
    if not overridden:
        return policy
    if isinstance(policy, _Policy):
        return _PolicyWithExempt(policy, tuple(set(classes)))
    return functools.partial(_or_policy, policies=[policy, functools.partial(
        _wrap_module_cls_individually, module_classes=classes)])


class _PolicyWithExempt(_Policy):
    """A wrap policy object's choice plus the modules of `classes`, as torch's
    _run_mixed_precision_override_policy adds them."""

    def __init__(self, policy, classes):
        self.policy, self.classes = policy, classes

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        targets = self.policy._run_policy(root_module, ignored_modules, root_kwargs)
        for sub in root_module.modules():
            if isinstance(sub, self.classes) and sub not in ignored_modules:
                targets.setdefault(sub, {})
        return targets


def _check_alike(module, ignored_params):
    """sync_module_states: raises ValueError, before any broadcast, where a rank's parameters
    and buffers (names, shapes, dtypes) are not rank 0's, so that the broadcasts cannot pair
    tensors of different parameters."""
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in
              list(module.named_parameters()) + list(module.named_buffers())
              if not isinstance(t, nn.Parameter) or t not in ignored_params]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, layout)
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        mine, first = dict((n, rest) for n, *rest in theirs), \
            dict((n, rest) for n, *rest in everyone[0])
        only = sorted(set(mine) - set(first))
        missing = sorted(set(first) - set(mine))
        differ = sorted(n for n in set(mine) & set(first) if mine[n] != first[n])
        raise ValueError(
            f"sync_module_states=True broadcasts rank 0's parameters and buffers, but rank "
            f"{rank}'s module has others: only on rank {rank}: {only[:5]}, only on rank 0: "
            f"{missing[:5]}, other shape or dtype: {differ[:5]}; build the module alike on "
            f"every rank (parameters tied on rank 0 and made on the meta device elsewhere come "
            f"apart when param_init_fn or to_empty(recurse=False) materializes them module by "
            f"module, as under torch's FSDP1: tie them again in param_init_fn)")


def _own_modules(module, path=""):
    """(path + ".", submodule) for module and its submodules, not entering nested
    FullyShardedDataParallel instances."""
    yield path, module
    for name, child in module.named_children():
        if not isinstance(child, FullyShardedDataParallel):
            yield from _own_modules(child, f"{path}{name}.")


class FullyShardedDataParallel(StateDicts, nn.Module):
    """torch's ``FullyShardedDataParallel`` with its 2.13 signature, built on
    ``dptc.fully_shard``.  See the module docstring."""

    def __init__(self, module, process_group=None, sharding_strategy=None, cpu_offload=None,
                 auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states=False, forward_prefetch=False,
                 limit_all_gathers=True, use_orig_params=False, ignored_states=None,
                 device_mesh=None, _root=True, _mesh=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        device = _device_of(module, device_id)
        # The root names replaced parameters by their names in the model (see [Note: an
        # optimizer built before wrapping]).
        model_names = list(module.named_parameters()) if _root else []
        if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
            raise TypeError(f"cpu_offload must be a CPUOffload, got {cpu_offload!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision, got "
                            f"{mixed_precision!r}")
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {strategy!r}")
        mesh = _mesh if _mesh is not None else _mesh_for(strategy, process_group, device_mesh,
                                                         device.type)
        for argname, value in (("ignored_modules", ignored_modules),
                               ("ignored_states", ignored_states)):
            if isinstance(value, (nn.Module, torch.Tensor)):
                raise TypeError(f"{argname} must be a list of modules or parameters, got a "
                                f"{type(value).__name__}; pass [it]")
        ignored_params = set()
        for ignored in list(ignored_modules or ()) + list(ignored_states or ()):
            if isinstance(ignored, nn.Module):
                ignored_params.update(ignored.parameters())
            else:
                ignored_params.add(ignored)
        if _root:
            # See [Note: the same model on every rank] in dptc/_same_model.py: checked here
            # for the whole model, before any unit is made, so that the message names
            # FullyShardedDataParallel rather than the fully_shard it is built on.
            _, shard, replicate = _mesh_groups(mesh, device.type)
            named = [(name, p) for name, p in model_names if p not in ignored_params]
            for group in (shard, replicate):
                check_same_parameters(
                    named, group, "FullyShardedDataParallel",
                    "build the module identically on every rank (the same layers in the same "
                    "order, shapes, dtypes and requires_grad) before wrapping it")
        if auto_wrap_policy is not None and mixed_precision is not None:
            auto_wrap_policy = _exempt_from_mixed_precision(
                module, auto_wrap_policy, mixed_precision._module_classes_to_ignore)
        targets = {} if auto_wrap_policy is None else {
            target: {**overrides, **getattr(target, "_wrap_overrides", {})}
            for target, overrides in
            policy_targets(module, auto_wrap_policy, ignored_params).items()
            if not any(p in ignored_params for p in target.parameters(recurse=False))}
        self._materialize(module, param_init_fn, device, list(targets))
        if device.type == "cuda":
            module.to(device)             # as torch's, for a module given with device_id
        if sync_module_states:
            self._broadcast_from_rank0(module, ignored_params)
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self._group_of = (mesh, 0 if mesh.ndim == 1 or strategy == ShardingStrategy.NO_SHARD
                          else 1)
        self._is_root_arg = _root
        self._settings = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                          FullOptimStateDictConfig())
        nested = dict(process_group=process_group, sharding_strategy=strategy,
                      cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                      mixed_precision=mixed_precision, device_id=device_id,
                      forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                      use_orig_params=use_orig_params, _root=False, _mesh=mesh)
        if targets:
            parents = {child: (parent, name) for parent in module.modules()
                       for name, child in parent.named_children()}
            for target, overrides in targets.items():
                kwargs = {**nested, **overrides}
                if {"sharding_strategy", "process_group", "device_mesh"} & overrides.keys():
                    kwargs.pop("_mesh")
                parent, name = parents[target]
                setattr(parent, name, FullyShardedDataParallel(
                    target, ignored_states=list(ignored_params), **kwargs))
        self._fsdp_wrapped_module = module
        # This instance's buffers in buffer_dtype: the nested instances cast theirs by their
        # own policy (none, for the modules exempt from mixed precision), as torch's.  State
        # dicts give them in the dtypes they had, as torch's.
        self._buffer_dtypes = {}
        if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
            for path, buffer_module in _own_modules(module):
                for name, buffer in buffer_module._buffers.items():
                    if buffer is not None and buffer.is_floating_point():
                        self._buffer_dtypes[path + name] = buffer.dtype
                        buffer_module._buffers[name] = buffer.to(mixed_precision.buffer_dtype)
        reshard = strategy not in (ShardingStrategy.SHARD_GRAD_OP,
                                   ShardingStrategy._HYBRID_SHARD_ZERO2)
        originals = list(module.named_parameters())
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard if not _root else None,
                    mp_policy=_policy_of(mixed_precision, _root),
                    ignored_params=ignored_params or None)
        _mark_replaced(originals, module)
        for name, param in model_names:
            if hasattr(param, _REPLACED):
                setattr(param, _REPLACED, name)
        # The unit's State, kept here: activation checkpointing applied later may put a
        # wrapper between this instance and the module it shards.
        state = self.__dict__["_fsdp_state"] = module.__dict__["_dptc_fsdp_state"]
        _set_prefetch(state, backward_prefetch, forward_prefetch)
        state.root_forward_check = self._root_forward_check
        if state.unit is not None:
            # no_sync accumulates in param_dtype, as torch's FSDP1 does.
            state.unit.accumulate_in_reduce_dtype = False
            state.unit.expose_unsynced_grads = True
        if state.unit is not None and mixed_precision is not None and \
                mixed_precision.keep_low_precision_grads:
            state.unit.keep_low_precision_grads = True
        self._register_state_dict_hook(FullyShardedDataParallel._post_state_dict)
        self._register_load_state_dict_pre_hook(FullyShardedDataParallel._pre_load_state_dict,
                                                with_module=True)
        self.register_load_state_dict_post_hook(FullyShardedDataParallel._clean_incompatible)

    # -- construction helpers -----------------------------------------------------------------

    @staticmethod
    def _materialize(module, param_init_fn, device, nested=()):
        """Modules still on the meta device (those nested instances did not take) get
        param_init_fn(m), one module at a time as torch calls it, or else to_empty on `device`
        and their own reset_parameters().  In torch's order, so that the same seed gives the
        same values: the modules of each instance the auto wrap policy will make (`nested`,
        children first, as torch's auto wrap constructs them), then the rest, each
        instance's breadth-first and stopping at the instances below it."""
        order, placed = [], set()
        for top in list(nested) + [module]:
            queue = collections.deque([top])
            while queue:
                current = queue.popleft()
                if current in placed:
                    continue
                placed.add(current)
                order.append(current)
                queue.extend(child for child in current.children()
                             if child not in placed and
                             not isinstance(child, FullyShardedDataParallel))
        pending = [m for m in order
                   if any(t.is_meta for t in list(m.parameters(recurse=False)) +
                          list(m.buffers(recurse=False)))]
        for sub in pending:
            if param_init_fn is not None:
                param_init_fn(sub)
                continue
            sub.to_empty(device=device, recurse=False)
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()

    @staticmethod
    def _broadcast_from_rank0(module, ignored_params):
        """sync_module_states: rank 0's parameters and buffers on every rank, except the
        ignored parameters (ignored_modules' and ignored_states'), which stay each rank's
        own, as torch's broadcasts only the parameters it manages."""
        from .. import collectives
        _check_alike(module, ignored_params)
        managed = [p for p in module.parameters() if p not in ignored_params]
        with torch.no_grad():
            for tensor in managed + list(module.buffers()):
                collectives.broadcast(tensor.data if tensor.is_contiguous() else tensor,
                                      src=0)

    # -- the module -----------------------------------------------------------------------------

    # See [Note: copies of a sharded module] in _fully_shard.py.  Defined here, not
    # forwarded to the wrapped module by __getattr__, so both raise torch's FSDP1's TypeError.
    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of a FullyShardedDataParallel is not supported, as with torch's "
            "(TypeError there too: \"cannot pickle 'module' object\"): its parameters are "
            "shards whose buffers, hooks and communication state belong to this instance. "
            "Copy the module before wrapping it and wrap the copy the same way (ema = "
            "copy.deepcopy(module), then FullyShardedDataParallel(ema, ...); or ema = "
            "torch.optim.swa_utils.AveragedModel(module), then ema.module = "
            "FullyShardedDataParallel(ema.module, ...)), or build and "
            "wrap a second model the same way and load this one's state: "
            "second.load_state_dict(model.state_dict())")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a FullyShardedDataParallel cannot be pickled (torch.save of the whole model), as "
            "with torch's (TypeError there too: \"cannot pickle 'module' object\"). Save its "
            "state dict instead: with FullyShardedDataParallel.state_dict_type(model, "
            "StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, "
            "rank0_only=True)): torch.save(model.state_dict(), path), or "
            "torch.distributed.checkpoint; load it into a model built and wrapped the same way")

    __copy__ = copy_as_object

    @property
    def process_group(self):
        """torch's FSDP1 attribute: the group this unit shards over (all ranks for NO_SHARD).
        Looked up through the mesh rather than held, so that dptc can free it at exit
        ([Note: torch groups at exit] in dptc/group.py)."""
        mesh, dim = self._group_of
        return mesh.get_group(dim)

    @property
    def module(self):
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _root_forward_check(self):
        """Run by the unit's pre-forward (outside dynamo) when this instance is the root."""
        if "_managed_params" not in self.__dict__:
            self._settle_nested_input_casts()
        self._refuse_post_accumulate_grad_hooks()

    def _settle_nested_input_casts(self):
        """At the root's first forward, instances made as roots (wrapped by hand, then wrapped
        again) turn out nested: as torch's, they cast their forward inputs by their
        MixedPrecision's cast_forward_inputs, not cast_root_forward_inputs."""
        for fsdp in self.fsdp_modules(self):
            if fsdp is self or not fsdp._is_root_arg or fsdp.mixed_precision is None:
                continue
            state = fsdp.__dict__["_fsdp_state"]
            state.mp_policy = dataclasses.replace(
                state.mp_policy, cast_forward_inputs=bool(fsdp.mixed_precision.cast_forward_inputs))

    # [Note: FSDP1 and post-accumulate-grad hooks]
    # torch's FullyShardedDataParallel runs no hook registered with
    # register_post_accumulate_grad_hook (or register_hook) on the parameters a script sees with
    # use_orig_params=True (autograd accumulates into its flat parameter, never into them),
    # and with use_orig_params=False, where the flat parameters are the parameters, runs them
    # on a flat parameter holding this rank's unsharded, unreduced gradient, in every backward
    # (no_sync's too).  dptc has no flat parameter, and fully_shard's own behaviour (the hooks
    # run after the reduced gradient, as torch's fully_shard runs them) would train to other
    # numbers than torch's FSDP1.  So the root's pre-forward refuses such hooks on the
    # parameters the instances manage (ignored parameters are autograd's leaves: their hooks
    # run as under torch), before any gather of that forward.

    def _refuse_post_accumulate_grad_hooks(self):
        managed = self.__dict__.get("_managed_params")
        if managed is None:
            managed = self.__dict__["_managed_params"] = [
                p.sharded for unit in _units_of(self.fsdp_modules(self)) for p in unit.params]
        hooked = [param for param in managed
                  if param._post_accumulate_grad_hooks or param._backward_hooks]
        if not hooked:
            return
        with original_names(FullyShardedDataParallel):
            names = [name for name, param in self.named_parameters()
                     if any(param is h for h in hooked)]
        post = any(param._post_accumulate_grad_hooks for param in hooked)
        kind = "register_post_accumulate_grad_hook" if post else "register_hook"
        remedy = ("; or shard with dptc.fully_shard, which runs post-accumulate-grad hooks "
                  "after the reduced gradient as torch's fully_shard does") if post else ""
        raise RuntimeError(
            f"{kind} on parameters of FullyShardedDataParallel ({', '.join(names)}): torch's "
            f"FullyShardedDataParallel never runs such hooks with use_orig_params=True, and "
            f"with use_orig_params=False runs them on its flat parameter with this rank's "
            f"unsharded, unreduced gradient, which dptc does not have; remove the hooks (the "
            f"handle's remove()){remedy}")

    def __getattr__(self, name):
        # Attributes the wrapper lacks are the wrapped module's, as with torch's.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key):
        return self._fsdp_wrapped_module.__getitem__(key)

    def apply(self, fn):
        """nn.Module.apply with the full parameters, as torch's: fn(module) for every module
        below and then this one, while this instance's unit holds its full parameters
        (each nested instance's apply gathers its own), changes written back into the
        shards.  So an initialisation such as ``model.apply(init_weights)`` after wrapping
        draws the full tensors from the generator, as in a single process."""
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    # As torch's: names carry the _fsdp_wrapped_module. prefixes, except inside
    # summon_full_params, where they are the original module's.
    _summoning = 0

    def named_parameters(self, *args, **kwargs):
        for name, param in super().named_parameters(*args, **kwargs):
            yield (clean(name) if FullyShardedDataParallel._summoning else name), param

    def named_buffers(self, *args, **kwargs):
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (clean(name) if FullyShardedDataParallel._summoning else name), buffer

    @staticmethod
    def fsdp_modules(module, root_only=False):
        """Every FullyShardedDataParallel instance in module's tree (the outermost only, with
        root_only)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            found = [m for m in found if not any(m is not o and any(m is x for x in o.modules())
                                                 for o in found)]
        return found

    def check_is_root(self):
        """Whether this instance is (or, before the first forward, will be) the root."""
        state = self.__dict__["_fsdp_state"]
        return state.root is state or state.root is None and self._is_root_arg

    def _require_root(self, method):
        """Raises, as torch's does, where `method` is called on a nested instance."""
        if not self.check_is_root():
            raise RuntimeError(f"{method}() should only be called on the root "
                               f"FullyShardedDataParallel instance, not on this nested one "
                               f"(wrapping {type(self.module).__name__}); call it on the "
                               f"model's outermost instance")

    # -- training -------------------------------------------------------------------------------

    def _units(self):
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate unsharded, without communication, inside the context; the
        first backward after it reduces their sum (memory: one unsharded gradient of the
        model per rank, as torch's).  On the root only, as torch's."""
        self._require_root("no_sync")
        units = self._units()
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clips the gradients of every parameter to a total norm of max_norm; returns the
        total norm before clipping (over all ranks' shards).  On the root only, as torch's:
        a nested instance would clip its own parameters by their norm alone."""
        self._require_root("clip_grad_norm_")
        units = _units_of(self.fsdp_modules(self))
        # The sharded parameters, whichever the modules hold now (a forward leaves some
        # unsharded), and the parameters no unit manages.
        params, managed, exposed = [], set(), set()
        for unit in units:
            for p in unit.params:
                params.append(p.sharded)
                managed.update(id(t) for t in (p.sharded, p.unsharded, p.summoned))
                if p.exposed is not None:
                    exposed.add(id(p.exposed))
        params += [p for p in self.parameters() if id(p) not in managed]
        grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        regular = [g for g in grads if id(g) not in exposed]
        total = torch.nn.utils.get_total_norm(regular, norm_type) if regular else None
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if exposed:
            # Gradients accumulated under no_sync(), this rank's own (see [Note: FSDP1's
            # gradients without sync]): their norms add over the shard group, as torch's
            # FSDP1 adds its ranks' unsharded gradients'.
            local = torch.nn.utils.get_total_norm(
                [g._local_tensor for g in grads if id(g) in exposed], norm_type)
            inf = norm_type == float("inf")
            part = local.clone() if inf else local.double() ** norm_type
            all_reduce(part, op=ReduceOp.MAX if inf else ReduceOp.SUM, group=units[0].group)
            if inf:
                total = part if total is None else torch.maximum(total, part.to(total.dtype))
            else:
                if total is not None:
                    part = part + total.double() ** norm_type
                total = (part ** (1.0 / norm_type)).to(local.dtype)
        if total is None:
            return torch.tensor(0.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.dtype))
        return total

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                           offload_to_cpu=False, with_grads=False):
        """Within the context the modules hold their full parameters in their original
        dtype (every instance in module's tree, or only module's own with recurse=False);
        with writeback, changes to them are copied back into the shards on exit.
        rank0_only: the other ranks keep their shards (writeback is then refused, as torch
        refuses it).  with_grads: the full gradients too.  offload_to_cpu changes nothing:
        the parameters are on the CPU."""
        if rank0_only and writeback:
            # NotImplementedError, as torch's raises it.
            raise NotImplementedError("summon_full_params(rank0_only=True, writeback=True) is "
                                      "not supported: the other ranks would have nothing to "
                                      "write back; pass writeback=False")
        instances = FullyShardedDataParallel.fsdp_modules(module) if recurse else [module]
        units = _units_of(instances)
        if any(unit.is_summoned() for unit in units):
            # torch's raises AssertionError too ("already unsharding parameters").
            raise AssertionError("summon_full_params inside summon_full_params of the same "
                                 "FullyShardedDataParallel instance is not supported (the "
                                 "inner one would gather the shards again, without the outer "
                                 "one's changes); use the outer context's full parameters")
        for unit in units:
            unit.reset_sharded()
            unit.summon(with_grads)
        if rank0_only and dist.get_rank() != 0:
            for unit in units:
                unit.unsummon(writeback=False)
        try:
            with original_names(FullyShardedDataParallel):
                yield
        finally:
            for unit in units:
                unit.unsummon(writeback and not rank0_only)

    def register_comm_hook(self, state, hook):
        """torch's FSDP1 communication hook, on the root for every instance of its tree:
        ``hook(state, grad)`` all-reduces a unit's flat gradient in place under NO_SHARD,
        ``hook(state, grad, output)`` reduce-scatters it into output under the sharded
        strategies; torch's default_hooks run on dptc's engine (see dptc/fsdp/_comm_hooks.py).
        Register it once, before the first forward; not for the hybrid strategies, as
        torch's."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        instances = self.fsdp_modules(self)
        for instance in instances:
            if instance.sharding_strategy in _HYBRID:
                raise AssertionError(f"Communication hook is not supported for hybrid "
                                     f"strategies: {instance.sharding_strategy}")
            if instance.__dict__.get("_comm_hook") is not None:
                raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        runs = resolve_comm_hook(hook)
        for instance in instances:
            instance.__dict__["_comm_hook"] = hook
            unit = instance.__dict__["_fsdp_state"].unit
            if unit is not None:
                unit.comm_hook = (state, runs)


def _units_of(instances):
    """The fully_shard units of FullyShardedDataParallel instances (one that holds no
    parameter of its own has none)."""
    units = [fsdp.__dict__["_fsdp_state"].unit for fsdp in instances]
    return [unit for unit in units if unit is not None]


def _fsdp_state_check(original):
    """torch.distributed.checkpoint.state_dict's check that a module it found is an FSDP
    instance: a dptc instance passes."""
    def check(module):
        return module if isinstance(module, FullyShardedDataParallel) else original(module)
    return check


# See [Note: wrappers in torch.distributed.checkpoint] in dptc/_dcp.py.
recognise(FullyShardedDataParallel, "FSDP",
          methods=("fsdp_modules", "state_dict_type", "optim_state_dict",
                   "optim_state_dict_to_load"),
          functions={"_get_module_fsdp_state_if_fully_sharded_module": _fsdp_state_check})
