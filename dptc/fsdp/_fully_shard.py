"""fully_shard and FSDPModule: torch 2.13's API, argument checking, nothing else.

The unit layout lives in _unit.py (and its state machine in csrc/unit.c), the hooks in
_state.py.
"""

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..group import default_group, new_group, resolve
from .._same_model import check_same_parameters
from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._state import State
from ._unit import SpmdLayout, Unit

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "share_comm_ctx"]

logger = logging.getLogger("dptc")

_FSDP_CLASSES = {}
_default_mesh = {}                  # device type -> the mesh over every rank


def copy_as_object(module):
    """copy.copy of a sharded module, whose __reduce_ex__ raises (see [Note: copies of a
    sharded module]): the shallow copy object's own reduction makes, as under torch."""
    import copy
    return copy._reconstruct(module, None, *object.__reduce_ex__(module, 4))


class FSDPModule(_TorchFSDPModule):
    """Mixed into every module fully_shard is applied to: ``FSDP<Name>`` subclasses both this
    and the module's own class, so ``isinstance(model, Transformer)`` still holds.

    It subclasses torch's FSDPModule so that code written for torch's ``fully_shard``
    recognises dptc's modules: pytorch/examples' FSDP2 ``inspect_model`` asserts
    ``isinstance(model, FSDPModule)`` with torch's class, and torchtitan's and torch's own
    tools (torch.distributed.pipelining) ask the same.  Every method of torch's class is
    defined here again (or raises NotImplementedError naming itself), so none of torch's
    runs on a dptc module."""

    # torch's __new__ finds the original class at this index of the MRO: FSDP<Name>, this
    # class, torch's FSDPModule, then <Name>.
    _orig_cls_mro_index = 3

    def __new__(cls, *args, **kwargs):
        # Containers (nn.Sequential slicing, ModuleList) construct type(self)(...): build the
        # original class, which has no FSDP state.
        original = cls.__mro__[cls._orig_cls_mro_index]
        self = original.__new__(original)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self):
        return self.__dict__["_dptc_fsdp_state"]

    # [Note: copies of a sharded module]
    # torch 2.13's fully_shard refuses copy.deepcopy (an AssertionError from the
    # __deepcopy__ it gives every FSDP<Name> class) and torch.save of the whole model fails
    # (pickle finds no FSDP<Name> class by its name: PicklingError); its FSDP1 fails both
    # with TypeError ("cannot pickle 'module' object").  dptc raises the same types, naming
    # the remedy.  A copy that trains would need what fully_shard makes, agreed by every
    # rank: shard buffers of its own (in shared memory on one node), units of its own in C
    # and hooks on its own modules; so the remedy is the copy users already make for
    # torch's wrappers, taken before sharding (or a second model loaded from the state
    # dict), then sharded the same way.  copy.copy keeps object's reduction, as under torch.
    def __deepcopy__(self, memo):
        raise AssertionError(
            f"copy.deepcopy of a fully_shard-ed {_class_name(self)} is not supported, as "
            f"with torch's fully_shard (AssertionError there too): its parameters are shards "
            f"whose buffers, hooks and communication state belong to this model. Copy the "
            f"model before fully_shard and apply fully_shard to the copy the same way (ema = "
            f"copy.deepcopy(model) before sharding, or ema = torch.optim.swa_utils."
            f"AveragedModel(model) before sharding and then fully_shard on ema.module; EMA "
            f"updates then run shard by shard on the DTensor parameters), or build and shard "
            f"a second model the same way and load this one's state: "
            f"second.load_state_dict(model.state_dict())")

    def __reduce_ex__(self, protocol):
        import pickle
        raise pickle.PicklingError(
            f"a fully_shard-ed {_class_name(self)} cannot be pickled (torch.save of the whole "
            f"model), as with torch's fully_shard (PicklingError there too: its FSDP<Name> "
            f"class cannot be found by name). Save the state instead: "
            f"torch.distributed.checkpoint (dcp.save(get_model_state_dict(model), "
            f"checkpoint_id=...)), or a full state dict: torch.save(get_model_state_dict("
            f"model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)), "
            f"path) on rank 0, loaded into a model built and sharded the same way")

    __copy__ = copy_as_object

    def _subtree_states(self):
        states = {}
        for m in self.modules():
            state = m.__dict__.get("_dptc_fsdp_state")
            if state is not None:
                states[id(state)] = state
        return list(states.values())

    def _apply(self, *args, **kwargs):
        # to_empty(), .to() and friends replace the parameters: adopt the new ones at once, so
        # state_dict() and load_state_dict() see the shard buffers before the first forward.
        # They apply to the sharded parameters, as torch's do: an unsharded unit reshards.
        state = self.__dict__.get("_dptc_fsdp_state")
        if state is not None and state.unit is not None:
            state.unit.reshard()
        # nn.Module's own _apply (past torch's FSDPModule, whose _apply reads torch's state).
        result = super(_TorchFSDPModule, self)._apply(*args, **kwargs)
        if state is not None and state.unit is not None:
            buckets = state.unit.buckets
            state.unit.reset_sharded()
            if state.unit.buckets is not buckets and state.root is not None:
                state.root.rings_stale = True   # see [Note: changing dtype after fully_shard]
        return result

    def reshard(self):
        """Frees this module's unsharded parameters and puts the sharded ones back (not
        recursive)."""
        state = self._fsdp_state()
        if state.unit is not None:
            state.unit.reshard()

    def unshard(self, async_op=False):
        """Gathers this module's parameters (not recursive).  With ``async_op=True`` returns an
        UnshardHandle; the module's next forward waits for it if the caller has not."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        state = self._fsdp_state()
        if state.unit is not None:
            state.unit.reset_sharded()
            state.unit.unshard()
        handle = UnshardHandle(state.unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self):
        """Recovers after an exception aborted a forward or backward: waits for or discards
        in-flight reductions, reshards everything, clears per-iteration state.  Call it on the
        root."""
        state = self._fsdp_state()
        if state.root is not None and state.root is not state:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard module "
                               "(the one whose forward runs first)")
        state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward):
        """Accepted for torch compatibility: dptc always waits for every reduction at the end
        of each backward, so every backward behaves as the last one."""
        self._fsdp_state().is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backward keeps the unsharded gradients and accumulates into them, without
        communication (memory: one unsharded gradient per parameter); the next backward with
        True reduces the sum.  For HSDP this covers both the reduce-scatter and the all-reduce."""
        self._set_flag("requires_gradient_sync", requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: whether gradients are all-reduced across replicas after the reduce-scatter."""
        self._set_flag("requires_all_reduce", requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """A bool, as torch's: True reshards over the whole shard group again, also where
        fully_shard was given an int."""
        self._set_flag("reshard_after_forward", reshard_after_forward, recurse)
        for state in self._subtree_states() if recurse else [self._fsdp_state()]:
            if state.unit is not None:
                state.unit.post_forward_group = None

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        self._set_flag("reshard_after_backward", reshard_after_backward, recurse)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params, *, recurse=True):
        """True: a parameter that got no gradient on this rank contributes zeros to the
        gradient reduction, and every parameter gets the reduced gradient (zeros where no
        rank used it), as torch's; needed where ranks take different branches inside a unit.
        [Note: unused parameters in a unit]
        A unit otherwise reduces once all its parameters have their gradients (their
        post-accumulate hooks), so on a rank that leaves one without, it reduces only at the
        end of backward, out of order with the ranks that reduced it on time (every rank
        raises CollectiveMismatchError).  With this flag the unit reduces at the end of
        backward on every rank, in the units' order, whatever its gradients: the same
        collectives everywhere, at the cost of its reduction no longer overlapping backward."""
        self._set_flag("reduce_scatter_unused_params", reduce_scatter_unused_params, recurse)

    def set_unshard_in_backward(self, unshard_in_backward):
        self._set_flag("unshard_in_backward", unshard_in_backward, False)

    def _set_flag(self, name, value, recurse):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
        states = self._subtree_states() if recurse else [self._fsdp_state()]
        for state in states:
            setattr(state, name, value)

    def set_modules_to_forward_prefetch(self, modules):
        """Explicit forward prefetching: this module's pre-forward starts gathering these."""
        self._fsdp_state().forward_prefetch = _states_of(modules, "modules")

    def set_modules_to_backward_prefetch(self, modules):
        """Explicit backward prefetching: this module's pre-backward starts gathering these."""
        self._fsdp_state().backward_prefetch = _states_of(modules, "modules")

    def set_gradient_divide_factor(self, factor):
        """Gradients are summed and divided by ``factor`` instead of averaged."""
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        state = self._fsdp_state()
        if state.unit is not None:
            state.unit.divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable):
        """True: this module's gradient collectives sum (ReduceOp.SUM), and the result is
        divided afterwards by the data-parallel size (shard group times replicas) or the
        factor of set_gradient_divide_factor, as torch's.  Not recursive, as torch's."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")
        state = self._fsdp_state()
        if state.unit is not None:
            state.unit.force_sum = enable

    def set_all_reduce_hook(self, hook, *, stream=None):
        """``hook(reduce_output)`` runs on each of this module's reduced gradients before they
        reach ``.grad``: this rank's shard in the reduce dtype, after the reduce-scatter
        (under HSDP after the replicas' all-reduce), before a post-division (force-sum or a
        divide factor); it may change the tensor in place.  ``stream``: a CUDA stream to
        run it on, only for a CUDA module without HSDP, as torch's.  Not recursive."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(reduce_output), got {hook!r}")
        state = self._fsdp_state()
        unit = state.unit
        if stream is not None:
            if unit is not None and unit.replicate_group is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            if unit is not None and unit.device.type != "cuda":
                raise ValueError(f"stream must be None for a module on {unit.device}: a "
                                 f"CPU module's hook runs where its reduction finishes")
        if unit is not None:
            unit.all_reduce_hook = (hook, stream)

    def set_post_optim_event(self, event):
        """torch's: an event recorded after the optimizer step, for the root's next
        all-gathers to wait on instead of everything queued on the current stream before
        them.  dptc's gathers follow the current stream, and the root's next forward makes
        that stream wait on a CUDA event first, so an optimizer step run on another stream is
        ordered before them too; then the event is dropped, as torch's root drops it after
        waiting.  The false dependency torch's API removes, on work queued on the current
        stream after the optimizer step, stays under dptc."""
        if not all(hasattr(event, name) for name in ("record", "wait")):
            raise TypeError(f"event must be a torch.Event (or torch.cuda.Event) recorded after "
                            f"the optimizer step, got {event!r}")
        self._fsdp_state().post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor):
        warnings.warn("set_reduce_scatter_divide_factor is deprecated in torch; use "
                      "set_gradient_divide_factor", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)


    # [Note: tuning methods that change no number]
    # torch's FSDPModule has knobs for how its CUDA collectives are staged and overlapped.
    # dptc's engine already does what they ask for, or has nothing they apply to, so each
    # checks its argument as torch's does and changes nothing: the gradients and parameters
    # are the same with them as without, as under torch (tests/test_fsdp.py).

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers, *, recurse=True):
        """Checked and accepted: dptc's reduce inputs lie in a ring of two shared buffers per
        group and dtype, with at most two reductions in flight (see [Note: reduce inputs in
        shared memory] in _unit.py), whatever this says."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got "
                             f"{max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable=True, *, recurse=True):
        """Checked and accepted: dptc's reduce-scatters already run on a stream of their own
        in the group (stream 1; the all-gathers on stream 0).  On CPU ranks that means they
        never wait behind an all-gather, which is what torch's separate process group is for;
        on CUDA the two streams share the group's NCCL communicator, whose kernels run in
        the order they were issued (see [Note: the NCCL transport] in csrc/nccl.h), so there
        a gather issued after a reduce-scatter still runs after it."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        """Checked and accepted: on one node dptc's collectives already read and write
        memory its transport shares between the ranks (the shard buffers, the reduce ring);
        a CUDA unit's buffers come from torch's allocator."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")

    def _set_unshard_async_op(self, async_op):
        """torch's private knob, which some training scripts set: checked and accepted (a
        dptc pre-forward or pre-backward waits only for its own unit's gather)."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")


def _unsupported(name, remedy="remove the call; dptc's fully_shard runs its collectives on "
                              "its own engine"):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"FSDPModule.{name} is not implemented by dptc: {remedy}")
    method.__name__ = name
    return method


_UNSUPPORTED = {
    "set_custom_all_gather": "a custom all-gather would replace dptc's engine; remove the "
                             "call, or shard this model with torch's fully_shard",
    "set_custom_reduce_scatter": "a custom reduce-scatter would replace dptc's engine; remove "
                                 "the call, or shard this model with torch's fully_shard",
    "set_symm_mem_for_comm": "NCCL symmetric memory is for torch's CUDA all-gathers; remove "
                             "the call (on one node dptc's CPU all-gathers already read every "
                             "rank's shard in place from shared memory)",
    "_get_fsdp_state": "it returns torch's internal FSDPState, which a dptc module does not "
                       "have; use FSDPModule's public methods",
}
for _name, _remedy in _UNSUPPORTED.items():
    setattr(FSDPModule, _name, _unsupported(_name, _remedy))
# Whatever else a later torch adds to its FSDPModule must not run on dptc's state either.
for _name, _value in vars(_TorchFSDPModule).items():
    if callable(_value) and not _name.startswith("__") and _name not in vars(FSDPModule):
        setattr(FSDPModule, _name, _unsupported(_name))


class _PipeliningState:
    """[Note: torch's pipelining]
    torch.distributed.pipelining drives a fully_shard stage by hand.  Before each micro-batch's
    backward its PipelineStage calls set_is_last_backward(False), set_reshard_after_backward
    (False) and set_requires_gradient_sync(False) on the stage module, which dptc's methods
    do; after the last one, perform_reduce_grad sets them True and reduces the accumulated
    gradients through torch's FSDP state of the module, ``fully_shard.state(module)`` (torch's
    fully_shard): each of ``state._state_ctx.all_states``' ``_fsdp_param_groups`` gets
    ``post_backward()``, then ``state._root_post_backward_final_callback()`` runs.  A dptc
    module answers that lookup with this object, registered where torch's contract keeps its
    states (the module's ``__dict__``; torch's registry of applied APIs is left alone): it
    has no param groups, and its final callback runs dptc's own end of backward on the root,
    which under those flags reshards every unit and reduces the gradients the micro-batches
    accumulated, as torch's post_backward and final callback do."""

    def __init__(self, state):
        self._dptc_state = state

    @property
    def _state_ctx(self):
        return self

    @property
    def all_states(self):
        return [self]

    _fsdp_param_groups = ()

    def _root_post_backward_final_callback(self):
        root = self._dptc_state.root
        if root is not None:          # None: no forward ran, nothing to reduce
            root._end_of_backward()


def _register_for_torch_pipelining(modules, state):
    """See [Note: torch's pipelining]; does nothing on a torch without that lookup."""
    try:
        from torch.distributed._composable.contract import STATE_KEY
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        key = torch_fully_shard.__wrapped__
    except (ImportError, AttributeError):
        return
    for module in modules:
        module.__dict__.setdefault(STATE_KEY, {})[key] = _PipeliningState(state)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` blocks until the gather is done and
    the unsharded parameters are on the module."""

    def __init__(self, unit):
        self._unit = unit

    def wait(self):
        # A unit sharded again meanwhile had its gather consumed by a forward (or reshard()):
        # nothing is left to wait for, as with torch's handle.
        if self._unit is not None and self._unit.state != "sharded":
            self._unit.wait_unshard()
        self._unit = None


def _states_of(modules, argname):
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{argname} must be a list of fully_shard modules, got "
                        f"{type(modules).__name__}")
    states = []
    for i, module in enumerate(modules):
        if not isinstance(module, FSDPModule):
            raise ValueError(f"{argname}[{i}] is a {type(module).__name__}, not a module "
                             f"fully_shard was applied to")
        states.append(module._fsdp_state())
    return states


def register_fsdp_forward_method(module, method_name):
    """Makes ``module.<method_name>()`` run fully_shard's forward hooks, like ``forward``
    (for example a ``generate`` method that calls submodules directly)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(f"module must be a module fully_shard was applied to, got "
                         f"{type(module).__name__}")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state()

    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules):
    """torch's: makes several fully_shard roots (the stages of one pipeline rank) share one
    set of communication streams.  dptc's units already share theirs: every unit on a group
    gathers on that group's stream 0 and reduces on its stream 1, whatever its root, so this
    checks its argument as torch's does and changes nothing."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"modules must be a list of fully_shard modules, got "
                        f"{type(modules).__name__}")
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


def _mesh_groups(mesh, device_type):
    """(mesh, shard group, replicate group or None) as dptc groups; the mesh on the parameters'
    device type ("cpu" or "cuda")."""
    if mesh is None:
        group = default_group()
        mesh = _default_mesh.get(device_type)
        if mesh is None or mesh.size() != group.size:
            mesh = _default_mesh[device_type] = init_device_mesh(device_type,
                                                                 (dist.get_world_size(),))
    _check_mesh(mesh, device_type, " or None")
    if mesh.ndim == 1:
        return mesh, resolve(mesh.get_group(0), "mesh"), None
    if mesh.ndim == 2:
        return mesh, resolve(mesh.get_group(1), "mesh"), resolve(mesh.get_group(0), "mesh")
    raise ValueError(f"mesh must have 1 dim (sharding) or 2 (replicate, shard) for HSDP, got "
                     f"{mesh.ndim} dims")


def _check_mesh(mesh, device_type, or_none=""):
    """Raises unless mesh is a DeviceMesh on device_type."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh (init_device_mesh){or_none}, got "
                        f"{type(mesh).__name__}")
    if mesh.device_type != device_type:
        raise ValueError(f"mesh is on device type {mesh.device_type!r} but the parameters are "
                         f"on {device_type!r}: init_device_mesh({device_type!r}, ...)")


def _spmd_groups(mesh, dp_mesh_dims, device_type):
    """dp_mesh_dims: (shard group, replicate group or None, SpmdLayout) of the whole SPMD
    mesh, checked as torch's fully_shard checks it."""
    if not all(hasattr(dp_mesh_dims, name) for name in ("shard_names", "replicate_names")):
        raise TypeError(f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, "
                        f"got {dp_mesh_dims!r}")
    if mesh is None:
        raise ValueError("dp_mesh_dims needs mesh=: the SPMD mesh the parameters are DTensors "
                         "on, with mesh_dim_names")
    _check_mesh(mesh, device_type)
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")

    def submesh(dims):     # several dims are flattened into one, as torch's fully_shard does
        return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))

    replicate_mesh = submesh(replicate) if replicate else None
    if shard:
        dp_mesh = shard_mesh = submesh(shard)
        if replicate_mesh is not None:
            dp_mesh = DeviceMesh._concatenate([replicate_mesh, shard_mesh])
        shard_group = resolve(shard_mesh.get_group(), "dp_mesh_dims")
    else:
        # Replicate only (torch's DDP through fully_shard): a shard group of one per rank,
        # the parameters whole on every rank, the gradients all-reduced over replicate.
        dp_mesh = replicate_mesh
        shard_group = _group_of_one(mesh.device_type)
    replicate_group = (resolve(replicate_mesh.get_group(), "dp_mesh_dims")
                       if replicate_mesh is not None else None)
    return shard_group, replicate_group, SpmdLayout(mesh, shard, replicate, dp_mesh)


def _check_spmd_param(param, where, mesh, dp_mesh_dims):
    """dp_mesh_dims: param must be a DTensor on the SPMD mesh, Replicate() on its
    data-parallel dims (torch's messages)."""
    if not isinstance(param, DTensor):
        raise ValueError(f"When dp_mesh_dims is provided, all parameters must be DTensors on the "
                         f"full SPMD mesh (e.g. via distribute_module). Got plain tensor for "
                         f"parameter '{where}'.")
    if param.device_mesh is not mesh:
        raise ValueError(f"Expected param's DTensor mesh to be the same mesh passed to "
                         f"fully_shard, but got different mesh objects ({where})")
    names = mesh.mesh_dim_names
    for role, dims in (("shard", dp_mesh_dims.shard_names),
                       ("replicate", dp_mesh_dims.replicate_names)):
        for name in dims:
            index = names.index(name)
            placement = param.placements[index]
            if not isinstance(placement, Replicate):
                raise ValueError(f"Expected Replicate() on DP {role} dim '{name}' (index "
                                 f"{index}) but got {placement} ({where})")
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise NotImplementedError(
                f"{where} is placed {param.placements}; dptc's fully_shard takes SPMD "
                f"parameters placed Shard(d) or Replicate() on every mesh dim")
    if not param._local_tensor.is_contiguous():
        raise ValueError(f"{where} is a DTensor whose local tensor is not contiguous; make it "
                         f"contiguous before fully_shard")


_blocks = {}     # (world group, members) -> dptc group of one block, see _block_group


def _group_of_one(device_type):
    """This rank's group of one (see _block_group: no other rank takes part)."""
    return _block_group([dist.get_rank()])


def _blocks_group(mesh, k):
    """reshard_after_forward=k: the dptc group of this rank's block of k consecutive ranks of
    mesh, its ranks viewed as (-1, k), as torch's fully_shard makes it (see [Note:
    resharding to a smaller group] in _unit.py)."""
    rows = mesh.mesh.reshape(-1, k).tolist()
    me = dist.get_rank()
    return _block_group(next(row for row in rows if me in row))


def _block_group(members):
    """The dptc group of `members` (global ranks, this rank among them), made once per
    default group so that the units of one model share it.  [Note: blocks meet locally]
    Only the members make it, meeting under their own ranks (dptc.new_group with
    use_local_synchronization=True): no world-wide collective, whose calls every rank would
    have to make alike.  A mesh torch's fully_shard is given may differ between ranks (a
    submesh: mesh["dp_shard"] of a (dp_shard, tp) mesh is [0, 2, 4, 6] on rank 0 and [1, 3,
    5, 7] on rank 1; a pipeline stage's data-parallel mesh), and a DeviceMesh over each
    rank's own blocks made torch groups in the same order but over other ranks: the groups
    numbered alike were [0, 2] on ranks 0 and 2 and [1, 3] on ranks 1 and 3, and ranks met
    the wrong peers (a shared segment of the wrong size) or waited in gloo's rendezvous."""
    world = default_group()
    key = (id(world), tuple(sorted(members)))
    group = _blocks.get(key)
    if group is None or group._c.closed:
        group = _blocks[key] = new_group(sorted(members), use_local_synchronization=True)
    return group


def _owned_modules(module):
    """module and its descendants, not descending into modules fully_shard was applied to."""
    yield module
    for child in module.children():
        if isinstance(child, FSDPModule):
            continue
        yield from _owned_modules(child)


def _collect_params(modules, ignored, spmd_mesh=None):
    """[(parameter, [(module, name), ...])] of the parameters these modules own; a parameter
    that a unit fully_shard made earlier manages gains the new locations instead.  Raises
    for a parameter tied to one an earlier unit sharded (its original is still here)."""
    found = {}
    for root in modules:
        for module in _owned_modules(root):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                managed = getattr(param, "_dptc_fsdp_param", None)
                if managed is not None and any(_contains(owner, root)
                                               for owner in managed.owners):
                    raise ValueError(
                        f"fully_shard is applied bottom-up: {type(root).__name__} lies inside "
                        f"a {type(managed.owners[0]).__name__} that fully_shard was applied to "
                        f"first; apply it to the blocks, then to their parents")
                sharded_by = getattr(param, "_dptc_fsdp_original_of", None)
                if sharded_by is not None:
                    _raise_tied_across_units(module, name, sharded_by)
                if managed is not None:
                    if (module, name) not in managed.locations:
                        managed.locations.append((module, name))
                    continue
                if isinstance(param, DTensor) and spmd_mesh is None:
                    _check_tensor_parallel(param, f"{type(module).__name__}.{name}")
                entry = found.setdefault(id(param), (param, []))
                entry[1].append((module, name))
    return list(found.values())


def _raise_tied_across_units(module, name, managed):
    """module.name still holds the original of a parameter an earlier fully_shard call
    sharded: it is tied to one of that unit's locations, which now hold the shard.  Sharding
    it again here would untie the two copies and train them apart, so raise as torch does."""
    owner, owner_name = managed.locations[0]
    raise ValueError(
        f"{_class_name(module)}.{name} is tied to {_class_name(owner)}.{owner_name}, which an "
        f"earlier fully_shard call (on {_class_name(managed.owners[0])}) already shards; tied "
        f"parameters must lie in one unit: apply fully_shard to the modules holding them at "
        f"once, fully_shard([module_a, module_b]), or leave them to a common parent's unit "
        f"(e.g. the root)")


def _class_name(module):
    """The module's own class name, without the FSDP<Name> class fully_shard gave it."""
    return next(c for c in type(module).__mro__ if not issubclass(c, _TorchFSDPModule)).__name__


def _check_tensor_parallel(param, where):
    """A DTensor parameter is a tensor-parallel one (see [Note: tensor-parallel parameters]
    in _unit.py): on a 1-D mesh, Shard or Replicate."""
    placements = param.placements
    if param.device_mesh.ndim != 1 or not all(type(p) in (Shard, Replicate)
                                              for p in placements):
        raise NotImplementedError(
            f"{where} is a DTensor on a {param.device_mesh.ndim}-D mesh placed {placements}; "
            f"dptc's fully_shard takes plain parameters and tensor-parallel DTensors on a 1-D "
            f"mesh placed Shard(d) or Replicate() (parallelize_module on mesh['tp'])")
    if not param._local_tensor.is_contiguous():
        raise ValueError(f"{where} is a DTensor whose local tensor is not contiguous; make it "
                         f"contiguous before fully_shard")


def _check_param(param, where):
    if param.dim() == 0:
        raise ValueError(f"{where} is a 0-dim parameter, which fully_shard cannot shard along "
                         f"dim 0; make it shape (1,) or pass it in ignored_params")
    if param.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{where} is on {param.device}, but dptc's fully_shard shards CPU, "
                         f"CUDA (or meta) parameters; move the module with .cpu() or .cuda()")


def _shard_dims(params, shard_placement_fn):
    """Each parameter's shard dim, as shard_placement_fn places it: Shard(dim) (a negative
    dim counts from the last), or None for Shard(0)."""
    if shard_placement_fn is None:
        return None   # Unit's default: every parameter on Shard(0)
    dims = []
    for param, locations in params:
        result = shard_placement_fn(param)
        if result is None:
            dims.append(0)
            continue
        module_, name = locations[0]
        where = f"{type(module_).__name__}.{name} (shape {tuple(param.shape)})"
        if type(result).__name__ == "ShardPlacementResult":
            raise NotImplementedError(f"shard_placement_fn returned a ShardPlacementResult for "
                                      f"{where}: dptc shards every parameter of a unit on its "
                                      f"mesh; return a Shard (or None for Shard(0))")
        if type(result) is not Shard:
            raise ValueError(f"shard_placement_fn must return a Shard or None, got {result!r} "
                             f"for {where}")
        dim = result.dim + param.dim() if result.dim < 0 else result.dim
        if not 0 <= dim < param.dim():
            raise ValueError(f"shard_placement_fn returned Shard({result.dim}) for {where}, "
                             f"which has no such dim; return Shard(d) with "
                             f"-{param.dim()} <= d < {param.dim()}")
        dims.append(dim)
    return dims


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                ignored_params=None, dp_mesh_dims=None):
    """Shards ``module``'s parameters across ``mesh`` (all ranks when None) with torch
    2.13's ``fully_shard`` semantics; returns the module, changed in place into an
    ``FSDP<Name>``.  Apply it to each block, then to the root.

    ``dp_mesh_dims`` (a ``DataParallelMeshDims``): ``mesh`` is then the whole SPMD mesh, the
    parameters DTensors on it placed Replicate() on its data-parallel dims; ``shard`` names
    the dim to shard over and ``replicate`` the one to replicate over (HSDP); see [Note:
    SPMD meshes] in _unit.py."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"module must be an nn.Module or a non-empty list of them, got "
                        f"{module!r}")
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}; "
                             f"apply it once per module")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be None or a callable taking a parameter "
                        f"and returning a Shard or None, got {shard_placement_fn!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        if not all(hasattr(mp_policy, f) for f in ("param_dtype", "reduce_dtype",
                                                    "output_dtype", "cast_forward_inputs")):
            raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp_policy, field)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"mp_policy.{field} must be None or a floating-point torch.dtype "
                            f"(torch.bfloat16, torch.float32, ...), got {value!r}")
    if not isinstance(offload_policy, OffloadPolicy) and \
            type(offload_policy).__name__ not in ("OffloadPolicy", "CPUOffloadPolicy"):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    cuda = any(p.device.type == "cuda" for m in modules for p in m.parameters())
    spmd = None
    if dp_mesh_dims is not None:
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"reshard_after_forward as int is not yet supported with SPMD mesh "
                f"(dp_mesh_dims), got {reshard_after_forward!r}; pass True or False (as with "
                f"torch's fully_shard)")
        shard_group, replicate_group, spmd = _spmd_groups(mesh, dp_mesh_dims,
                                                          "cuda" if cuda else "cpu")
    else:
        mesh, shard_group, replicate_group = _mesh_groups(mesh, "cuda" if cuda else "cpu")
    post_forward_group = None
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        size = shard_group.size
        if not isinstance(reshard_after_forward, int) or not 1 <= reshard_after_forward <= size \
                or size % reshard_after_forward:
            raise ValueError(f"reshard_after_forward must be None, a bool, or an int that "
                             f"divides the shard group size {size}; got "
                             f"{reshard_after_forward!r}")
        if reshard_after_forward == 1:
            reshard_after_forward = False
        elif reshard_after_forward == size:
            reshard_after_forward = True
        else:
            post_forward_group = _blocks_group(mesh, reshard_after_forward)
            reshard_after_forward = True
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError(f"ignored_params must be a set of parameters, got a "
                        f"{type(ignored_params).__name__} of shape {tuple(ignored_params.shape)}; "
                        f"pass {{parameter}}")
    ignored = set(ignored_params or ())
    params = _collect_params(modules, ignored, spmd_mesh=mesh if spmd else None)
    for param, locations in params:
        module_, name = locations[0]
        _check_param(param, f"{type(module_).__name__}.{name}")
        if spmd is not None:
            _check_spmd_param(param, f"{type(module_).__name__}.{name}", mesh, dp_mesh_dims)
    # See [Note: the same model on every rank] in dptc/_same_model.py.
    named = [(f"{type(locations[0][0]).__name__}.{locations[0][1]}", param)
             for param, locations in params]
    remedy = ("build the module identically on every rank (the same layers in the same order, "
              "shapes, dtypes and requires_grad) and apply fully_shard to the same modules in "
              "the same order on every rank")
    for group in (shard_group, replicate_group):
        check_same_parameters(named, group, f"fully_shard of {type(modules[0]).__name__}",
                              remedy)
    dims = _shard_dims(params, shard_placement_fn)
    unit = (Unit(params, mesh, shard_group, replicate_group, mp_policy, dims, spmd)
            if params else None)
    if unit is not None:
        unit.post_forward_group = post_forward_group
        for p, (param, _) in zip(unit.params, params):
            p.owners = modules
            p.sharded._dptc_fsdp_param = p
            # Still held wherever it is tied outside these modules: see _collect_params.
            param._dptc_fsdp_original_of = p
    state = State(modules, unit, mp_policy, reshard_after_forward)
    _register_for_torch_pipelining(modules, state)
    for m in modules:
        m.__dict__["_dptc_fsdp_state"] = state
        cls = type(m)
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _FSDP_CLASSES[cls] = fsdp_cls
        m.__class__ = fsdp_cls
    logger.info("Applied fully_shard to %s (%d parameters)", type(modules[0]).__name__,
                len(params))
    return module


def _contains(ancestor, module):
    return any(m is module for m in ancestor.modules())
