"""Configuration of fully_shard: torch 2.13's policy classes, same fields and defaults."""

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a unit's compute and communication.

    ``param_dtype``: the unsharded parameters' dtype, used by forward and backward and by the
    all-gather (the shards are cast before it).  ``reduce_dtype``: the dtype gradients are
    reduce-scattered in (defaults to ``param_dtype``).  ``output_dtype``: forward outputs are cast
    to it.  ``cast_forward_inputs``: floating-point forward inputs are cast to ``param_dtype``.
    The sharded parameters, what the optimizer updates, keep their original dtype.
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: the sharded parameters stay on their device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state live in CPU memory.  dptc's CPU
    transport already keeps them there, so on CPU this changes nothing; ``pin_memory`` matters
    once parameters are on a GPU."""
    pin_memory: bool = True


try:   # torch's own where it has one (2.13), so isinstance checks written for torch hold
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    @dataclass
    class DataParallelMeshDims:
        """Which dims of the SPMD mesh passed to fully_shard are data-parallel: ``shard``
        names the one to shard over, ``replicate`` the one to replicate over (HSDP)."""
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self):
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in "
                                 "DataParallelMeshDims")

        @property
        def shard_names(self):
            return _names(self.shard)

        @property
        def replicate_names(self):
            return _names(self.replicate)

    def _names(value):
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)
