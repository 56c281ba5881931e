"""FSDP on dptc's engine: ``fully_shard`` with torch 2.13's API.

``from dptc import fully_shard, MixedPrecisionPolicy, FSDPModule`` replaces the same names from
``torch.distributed.fsdp``.
"""

from ._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
