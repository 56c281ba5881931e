"""FullyShardedDataParallel's state dicts (FSDP1's API): the model's, FULL and SHARDED, keyed by
the original parameter names, and the optimizer's, today's API and the one before it, as torch
2.13's FSDP1 gives them, over fully_shard's DTensor shards.  StateDicts is a base class of
FullyShardedDataParallel (dptc/fsdp/_fsdp1.py), which registers _post_state_dict,
_pre_load_state_dict and _clean_incompatible on every instance."""

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                    OptimStateKeyType, ShardedOptimStateDictConfig,
                                    ShardedStateDictConfig, StateDictSettings, StateDictType)
from torch.distributed.tensor import DTensor

from .._dcp import torch_methods

__all__ = ["StateDicts", "PREFIX", "clean", "original_names", "as_shard"]

PREFIX = "_fsdp_wrapped_module."


def clean(name):
    """A parameter's or buffer's name without the _fsdp_wrapped_module. prefixes."""
    return name.replace(PREFIX, "")


class StateDicts:
    """The state-dict methods of FullyShardedDataParallel."""

    @classmethod
    def set_state_dict_type(cls, module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None):
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(f"state_dict_type must be a StateDictType, got {state_dict_type!r}")
        if state_dict_type not in (StateDictType.FULL_STATE_DICT,
                                   StateDictType.SHARDED_STATE_DICT):
            raise NotImplementedError(f"{state_dict_type} is not implemented by dptc; use "
                                      f"FULL_STATE_DICT or SHARDED_STATE_DICT")
        full = state_dict_type == StateDictType.FULL_STATE_DICT
        config = state_dict_config or (FullStateDictConfig() if full
                                       else ShardedStateDictConfig())
        optim_config = optim_state_dict_config or (FullOptimStateDictConfig() if full
                                                   else ShardedOptimStateDictConfig())
        expected = (FullStateDictConfig, FullOptimStateDictConfig) if full else \
            (ShardedStateDictConfig, ShardedOptimStateDictConfig)
        for given, kind in zip((config, optim_config), expected):
            if not isinstance(given, kind):
                raise RuntimeError(f"{state_dict_type} takes a {kind.__name__}, got "
                                   f"{type(given).__name__}; pass a {kind.__name__} or None")
        previous = None
        for fsdp in cls.fsdp_modules(module):
            previous = previous or fsdp._settings
            fsdp._settings = (state_dict_type, config, optim_config)
        # As torch's: the settings before, as StateDictSettings.
        return StateDictSettings(*previous) if previous is not None else None

    @classmethod
    def get_state_dict_type(cls, module):
        """The StateDictSettings of module's FullyShardedDataParallel instances (the same for
        all of them, or AssertionError)."""
        settings = [fsdp._settings for fsdp in cls.fsdp_modules(module)]
        for other in settings[1:]:
            if other != settings[0]:
                raise AssertionError(f"All FSDP modules must have the same state dict "
                                     f"settings. Got {other} and {settings[0]}.")
        return StateDictSettings(*settings[0]) if settings else None

    @classmethod
    @contextlib.contextmanager
    def state_dict_type(cls, module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Within the context, ``state_dict()`` and ``load_state_dict()`` of module's
        FullyShardedDataParallel instances use ``state_dict_type``: FULL_STATE_DICT (full
        tensors; FullStateDictConfig(offload_to_cpu, rank0_only)) or SHARDED_STATE_DICT (the
        DTensor shards)."""
        previous = cls.set_state_dict_type(module, state_dict_type,
                                                                state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield
        finally:
            if previous is not None:
                cls.set_state_dict_type(
                    module, previous.state_dict_type, previous.state_dict_config,
                    previous.optim_state_dict_config)

    def _post_state_dict(self, state_dict, prefix, local_metadata):
        kind, config = self._settings[:2]
        full = kind == StateDictType.FULL_STATE_DICT
        rank0_only = full and getattr(config, "rank0_only", False)
        # This instance's keys are the last ones in the dict, in the wrapped module's order,
        # with those of nested instances already as torch's names them: every one is taken
        # out and put back in that order, so the dict keeps the module's order, as torch's.
        own, cleaned = prefix + PREFIX, clean(prefix)
        for key in [k for k in state_dict if k.startswith(prefix) or k.startswith(cleaned)]:
            value = state_dict.pop(key)
            if not key.startswith(own):
                state_dict[key] = value
                continue
            if full and isinstance(value, DTensor):
                local = value.to_local()
                value = value.full_tensor()
                if value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                    # Nothing to gather (NO_SHARD, or a shard group of one): full_tensor()
                    # gave the parameter itself, and the dict is a snapshot.
                    value = value.detach().clone()
            elif isinstance(value, DTensor):
                # A copy of the shard, as torch's FSDP1 gives: the dict is a snapshot that
                # training does not change (see [Note: FSDP1 state dicts are snapshots]).
                value = value.detach().clone()
            if rank0_only and dist.get_rank() != 0:
                continue
            dtype = self._buffer_dtypes.get(clean(key[len(prefix):]))
            if dtype is not None and value.dtype != dtype:
                value = value.to(dtype)
            state_dict[clean(key)] = value
        return state_dict

    @staticmethod
    def _clean_incompatible(module, incompatible_keys):
        """load_state_dict's missing and unexpected keys (and strict's error) name the keys
        as the state dict does, without the _fsdp_wrapped_module. prefixes, as torch's."""
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [clean(key) for key in keys]

    @staticmethod
    def _pre_load_state_dict(module, state_dict, prefix, *args):
        for key in [k for k in state_dict if k.startswith(prefix)
                    and not k[len(prefix):].startswith(PREFIX)]:
            value = state_dict.pop(key)
            target = module._fsdp_wrapped_module
            path = key[len(prefix):]
            state_dict[prefix + PREFIX + path] = as_shard(target, path, value)

    @classmethod
    def optim_state_dict(cls, model, optim, optim_state_dict=None, group=None):
        """The optimizer's state dict keyed by parameter names, full tensors under
        FULL_STATE_DICT (on rank 0 only with FullOptimStateDictConfig(rank0_only=True)) and
        DTensor shards under SHARDED_STATE_DICT."""
        return _optimizer_state(model, optim, *_optim_settings(cls, model))

    # -- the optimizer state-dict API before optim_state_dict (torch: deprecated) ---------------

    @staticmethod
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        """The full optimizer state keyed by parameter names; with rank0_only, on rank 0 (the
        other ranks get {})."""
        _warn_legacy("full_optim_state_dict", "optim_state_dict")
        return _optimizer_state(model, optim, full=True, rank0_only=rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model, optim, group=None):
        """The optimizer state keyed by parameter names, each rank's shards as DTensors (where
        torch's FSDP1 gives ShardedTensors)."""
        _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
        return _optimizer_state(model, optim, full=False, rank0_only=False)

    @classmethod
    def shard_full_optim_state_dict(cls, full_optim_state_dict, model, optim_input=None,
                                    optim=None):
        """full_optim_state_dict (keyed by names, on every rank) as this rank's part, keyed by
        parameter IDs: what ``optim.load_state_dict`` takes for model's sharded parameters."""
        _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
        return _loadable(cls, full_optim_state_dict, model, optim)

    @classmethod
    def flatten_sharded_optim_state_dict(cls, sharded_optim_state_dict, model, optim):
        """sharded_optim_state_dict's result as what ``optim.load_state_dict`` takes."""
        _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        return _loadable(cls, sharded_optim_state_dict, model, optim)

    @classmethod
    def scatter_full_optim_state_dict(cls, full_optim_state_dict, model, optim_input=None,
                                      optim=None, group=None):
        """shard_full_optim_state_dict with the full state on rank 0 only (None elsewhere):
        its tensors are broadcast from rank 0 through dptc's engine."""
        _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
        return _loadable(cls, _broadcast_from_rank0(full_optim_state_dict), model, optim)

    @classmethod
    def rekey_optim_state_dict(cls, optim_state_dict, optim_state_key_type, model, optim_input=None,
                               optim=None):
        """optim_state_dict keyed by parameter names (OptimStateKeyType.PARAM_NAME) or by
        parameter IDs (PARAM_ID: the positions in optim's parameters, else in
        model.parameters()), its values unchanged."""
        if not isinstance(optim_state_key_type, OptimStateKeyType):
            raise TypeError(f"optim_state_key_type must be an OptimStateKeyType, got "
                            f"{optim_state_key_type!r}")
        ids, names = _parameter_ids(cls, model, optim)
        to_id = optim_state_key_type == OptimStateKeyType.PARAM_ID
        mapping = ({name: ids[param] for param, name in names.items() if param in ids} if to_id
                   else {ids[param]: name for param, name in names.items() if param in ids})
        state = optim_state_dict["state"]
        if all(isinstance(key, int) == to_id for key in state):
            return optim_state_dict
        return {"state": {mapping[key]: value for key, value in state.items()},
                "param_groups": [dict(group, params=sorted(mapping[key]
                                                           for key in group["params"]))
                                 for group in optim_state_dict["param_groups"]]}

    @classmethod
    def optim_state_dict_to_load(cls, model, optim, optim_state_dict, is_named_optimizer=False,
                                 load_directly=False, group=None):
        """Loads optim_state_dict (from optim_state_dict) into optim; returns the optimizer's
        resulting state dict, ready for ``optim.load_state_dict``.  Under FULL_STATE_DICT with
        FullOptimStateDictConfig(rank0_only=True), rank 0's is broadcast."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)
        full, rank0_only = _optim_settings(cls, model)
        # The loader names parameters as optim_state_dict does, without the prefixes (see
        # [Note: wrappers in torch.distributed.checkpoint] in dptc/_dcp.py).
        with torch_methods():
            set_optimizer_state_dict(model, optim, optim_state_dict, options=StateDictOptions(
                full_state_dict=full, broadcast_from_rank0=rank0_only))
        # See [Note: FSDP1 state dicts are snapshots].
        given = _storages(optim_state_dict)
        for entries in optim.state.values():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and _storage(value) in given:
                    entries[key] = value.detach().clone()
        return optim.state_dict()


def _optimizer_state(model, optim, full, rank0_only):
    """optim's state dict keyed by the original parameter names (see [Note: wrappers in
    torch.distributed.checkpoint] in dptc/_dcp.py): full tensors (on rank 0 only with
    rank0_only) or this rank's DTensor shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    from torch.utils._pytree import tree_map
    with torch_methods():
        state = get_optimizer_state_dict(model, optim, options=StateDictOptions(
            full_state_dict=full, cpu_offload=rank0_only))
    # See [Note: FSDP1 state dicts are snapshots].
    live = _storages(optim.state)
    return tree_map(lambda value: value.detach().clone() if isinstance(value, torch.Tensor)
                    and _storage(value) in live else value, state)


# [Note: FSDP1 state dicts are snapshots]
# torch's FSDP1 builds its state dicts from new tensors (ShardedTensors of copied shards,
# gathered full tensors, flattened optimizer state), so a script may keep one in memory and
# train on: an in-process rollback, or a second model and optimizer loaded from the first's.
# fully_shard's state dicts hold the live DTensor shards and optimizer tensors instead. So the
# SHARDED model state dict copies each shard, optim_state_dict copies every tensor it shares
# with the optimizer (shards, step counters), and optim_state_dict_to_load leaves the
# optimizer no tensor of the dict it was given, as torch's FSDP1 does.


def _storage(tensor):
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _storages(tree):
    """The storage addresses of the tensors in tree (DTensors: their local tensors)."""
    from torch.utils._pytree import tree_flatten
    return {_storage(value) for value in tree_flatten(tree)[0]
            if isinstance(value, torch.Tensor) and value.numel()}


def _optim_settings(cls, model):
    """(full, rank0_only) of model's optimizer state-dict settings."""
    settings = cls.get_state_dict_type(model)
    if settings is None:
        raise ValueError(f"model holds no FullyShardedDataParallel instance "
                         f"({type(model).__name__}); pass the model the optimizer trains")
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    return full, full and bool(getattr(settings.optim_state_dict_config, "rank0_only", False))


def _warn_legacy(current, replacement):
    warnings.warn(f"``FullyShardedDataParallel.{current}``is being deprecated and is replaced "
                  f"by ``FullyShardedDataParallel.{replacement}``. "
                  f"``FullyShardedDataParallel.{current}`` may be removed after PyTorch 2.2.",
                  FutureWarning, stacklevel=3)


def _parameter_ids(cls, model, optim):
    """({parameter: its ID}, {parameter: its original name}): IDs are the positions in optim's
    parameter groups, or in model.parameters() without an optimizer."""
    params = [p for group in optim.param_groups for p in group["params"]] if optim is not None \
        else list(model.parameters())
    with original_names(cls):
        names = {param: name for name, param in model.named_parameters()}
    return {param: k for k, param in enumerate(params)}, names


def _loadable(cls, optim_state_dict, model, optim):
    """An optimizer state dict keyed by names (full tensors, or DTensor shards) as
    ``optim.load_state_dict`` takes it for model's parameters: keyed by parameter IDs, every
    tensor shaped like its parameter laid out as that parameter (its DTensor shard)."""
    ids, names = _parameter_ids(cls, model, optim)
    by_name = {name: param for param, name in names.items() if param in ids}
    state = {}
    for name, entries in optim_state_dict["state"].items():
        param = by_name.get(name)
        if param is None:
            raise KeyError(f"optimizer state for {name!r}, which is not a parameter of the "
                           f"model that optim updates; pass the model the state was saved "
                           f"from")
        state[ids[param]] = {key: _laid_out_as(param, value) for key, value in entries.items()}
    groups = [dict(group, params=sorted(ids[by_name[name]] for name in group["params"]))
              for group in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def _laid_out_as(param, value):
    """value in param's layout when it has param's shape (a full tensor, or a DTensor of
    another layout), else unchanged (a step counter)."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or \
            tuple(value.shape) != tuple(param.shape):
        return value
    if isinstance(value, DTensor):
        if value.placements == param.placements and value.device_mesh == param.device_mesh:
            return value
        value = value.full_tensor()
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


class _TensorSlot:
    """Where a tensor of rank 0's state dict goes, in the structure sent to the others."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _broadcast_from_rank0(optim_state_dict):
    """Rank 0's optimizer state dict on every rank: its structure through the store, each
    tensor through dptc's broadcast, in the structure's order."""
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
    from ..collectives import broadcast
    rank = dist.get_rank()
    if rank == 0 and optim_state_dict is None:
        raise ValueError("scatter_full_optim_state_dict: rank 0 must pass the full optimizer "
                         "state dict (from full_optim_state_dict), got None")
    box = [tree_map(lambda v: _TensorSlot(tuple(v.shape), v.dtype)
                    if isinstance(v, torch.Tensor) else v, optim_state_dict)
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    slots, spec = tree_flatten(box[0])
    values = tree_flatten(optim_state_dict)[0] if rank == 0 else [None] * len(slots)
    out = []
    for slot, value in zip(slots, values):
        if not isinstance(slot, _TensorSlot):
            out.append(slot)
            continue
        tensor = value.detach().cpu().contiguous() if rank == 0 else \
            torch.empty(slot.shape, dtype=slot.dtype)
        broadcast(tensor, src=0)
        out.append(tensor)
    return tree_unflatten(out, spec)


@contextlib.contextmanager
def original_names(cls):
    """cls's named_parameters() without the _fsdp_wrapped_module. prefixes, so optimizer state
    dicts are keyed by the original names, as FSDP1's are."""
    cls._summoning += 1
    try:
        yield
    finally:
        cls._summoning -= 1


def as_shard(module, path, value):
    """A full tensor loaded into a sharded parameter becomes that rank's DTensor piece."""
    *owners, name = path.split(".")
    target = module
    for owner in owners:
        target = getattr(target, owner, None)
        if target is None:
            return value
    param = target._parameters.get(name) if isinstance(target, nn.Module) else None
    return value if isinstance(value, DTensor) else _laid_out_as(param, value)
