"""dptc: data-parallel training for PyTorch with a C core.

Change one import: ``from dptc import DistributedDataParallel as DDP``.
"""

import importlib
import os

try:
    from . import _C
except ImportError as error:
    # A source tree with no build shadows an installed dptc when its folder is on sys.path
    # (the current directory with `python -m`); Python then reports a circular import.
    raise ImportError(
        f"dptc's C extension is not built in {os.path.dirname(__file__)}: build it there "
        f"(pip install --no-build-isolation -e ., or python setup.py build_ext --inplace), or run "
        f"from outside this source tree to use an installed dptc") from error
from ._C import (CollectiveMismatchError, CudaLibraryError, DistError, DistTimeoutError,
                 PeerLostError)
from .collectives import (ReduceOp, all_gather_into_tensor, all_gather_into_tensors,
                          all_gather_single, all_reduce, barrier, broadcast,
                          reduce_scatter_single, reduce_scatter_tensor)
from .group import (ProcessGroup, destroy_process_group, get_rank, get_world_size,
                    init_process_group, is_initialized, new_group)

# What dptc.fsdp holds, imported on first use (see __getattr__).
_FSDP_NAMES = (
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    "share_comm_ctx", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "DataParallelMeshDims", "fully_shard_by_policy",
    "policy_targets", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
    "lambda_auto_wrap_policy", "ModuleWrapPolicy", "CustomPolicy", "always_wrap_policy",
    "enable_wrap", "wrap", "checkpoint_wrapper", "apply_activation_checkpointing",
    "CheckpointImpl", "CheckpointWrapper", "FullyShardedDataParallel", "FSDP",
    "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
    "FullStateDictConfig", "ShardedStateDictConfig",
)

__all__ = [
    "DistError", "DistTimeoutError", "PeerLostError", "CollectiveMismatchError",
    "CudaLibraryError", "ReduceOp", "all_reduce", "broadcast", "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single", "reduce_scatter_single", "all_gather_into_tensors", "barrier",
    "ProcessGroup", "init_process_group", "destroy_process_group", "is_initialized", "new_group",
    "get_rank", "get_world_size", "DistributedDataParallel", "DDP", "Join", *_FSDP_NAMES,
]

__version__ = "0.1.0"


def __getattr__(name):
    # DDP and FSDP import torch.nn and DTensor machinery; load them on first use.
    if name in ("DistributedDataParallel", "DDP"):
        from .ddp import DistributedDataParallel
        return DistributedDataParallel
    if name == "Join":
        from .join import Join
        return Join
    if name in _FSDP_NAMES:
        from . import fsdp
        return getattr(fsdp, "FullyShardedDataParallel" if name == "FSDP" else name)
    if name in ("comm_hooks", "ddp", "bench", "fsdp"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dptc' has no attribute {name!r}")
