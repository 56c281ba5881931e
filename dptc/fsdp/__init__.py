"""FSDP on dptc's engine: ``fully_shard`` with torch 2.13's API.

``from dptc import fully_shard, MixedPrecisionPolicy, FSDPModule`` replaces the same names from
``torch.distributed.fsdp``.
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp1 import (BackwardPrefetch, CPUOffload, FullStateDictConfig,
                     FullyShardedDataParallel, MixedPrecision, ShardedStateDictConfig,
                     ShardingStrategy, StateDictType)
from ._fully_shard import (FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method,
                           share_comm_ctx)
from ._wrap import (CheckpointImpl, CheckpointWrapper, CustomPolicy, ModuleWrapPolicy,
                    always_wrap_policy, apply_activation_checkpointing, checkpoint_wrapper,
                    enable_wrap, fully_shard_by_policy, lambda_auto_wrap_policy,
                    policy_targets, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
                    wrap)

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "share_comm_ctx",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims",
           "fully_shard_by_policy",
           "policy_targets", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "lambda_auto_wrap_policy", "ModuleWrapPolicy", "CustomPolicy", "always_wrap_policy",
           "enable_wrap", "wrap", "checkpoint_wrapper", "apply_activation_checkpointing",
           "CheckpointImpl", "CheckpointWrapper", "FullyShardedDataParallel", "ShardingStrategy",
           "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
           "FullStateDictConfig", "ShardedStateDictConfig"]
