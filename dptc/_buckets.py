"""DDP's gradient buckets: how many bytes each holds (BucketPolicy, from bucket_cap_mb and
bucket_cap_mb_list, as torch's) and which parameters go in which (assign_buckets,
first_buckets): pure functions of sizes, dtypes and order, which csrc/reducer.c then fills
and launches."""

import dataclasses
import math
import sys

__all__ = ["BucketPolicy", "assign_buckets", "first_buckets", "DEFAULT_BUCKET_CAP_MB"]

_MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: the first bucket (the gradients that are
# ready first) is small, so communication starts early in backward.
_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """Byte limits of gradient buckets, per dtype, in launch order.

    The k-th bucket of a dtype closes once it holds at least ``limit(k)`` bytes:
    ``first_bucket_bytes`` for k = 0, ``bucket_bytes`` after; ``per_bucket_bytes`` (from
    ``bucket_cap_mb_list``) overrides both, its last entry repeating.
    """
    bucket_bytes: int
    first_bucket_bytes: int
    per_bucket_bytes: tuple = ()

    def limit(self, k):
        if self.per_bucket_bytes:
            return self.per_bucket_bytes[min(k, len(self.per_bucket_bytes) - 1)]
        return self.first_bucket_bytes if k == 0 else self.bucket_bytes

    def first_backward(self, find_unused_parameters, static_graph):
        """The policy of the buckets before the first backward's order is known, as torch's:
        one bucket per dtype, unless find_unused_parameters (without static_graph) keeps the
        first buckets for good, or bucket_cap_mb_list sets every bucket's size."""
        if self.per_bucket_bytes or (find_unused_parameters and not static_graph):
            return self
        return BucketPolicy(bucket_bytes=sys.maxsize, first_bucket_bytes=sys.maxsize)

    @classmethod
    def create(cls, bucket_cap_mb, bucket_cap_mb_list=None):
        if bucket_cap_mb_list:
            caps = tuple(_cap_bytes(cap, "bucket_cap_mb_list entry") for cap in bucket_cap_mb_list)
            return cls(bucket_bytes=max(caps), first_bucket_bytes=caps[0], per_bucket_bytes=caps)
        if bucket_cap_mb is None:
            return cls(bucket_bytes=DEFAULT_BUCKET_CAP_MB * _MB,
                       first_bucket_bytes=_DEFAULT_FIRST_BUCKET_BYTES)
        cap = _cap_bytes(bucket_cap_mb, "bucket_cap_mb")
        return cls(bucket_bytes=cap, first_bucket_bytes=cap)


def _cap_bytes(cap_mb, argname):
    """The cap in bytes, truncated as torch truncates it: 0 (or under a byte) closes every
    bucket at its first parameter, as torch's bucket assignment does."""
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)):
        raise TypeError(f"{argname} must be a number of MiB, got {cap_mb!r}")
    if not math.isfinite(cap_mb) or cap_mb < 0:
        raise ValueError(f"{argname} must be >= 0, got {cap_mb}; pass None for the default "
                         f"({DEFAULT_BUCKET_CAP_MB} MiB)")
    return int(cap_mb * _MB)


def assign_buckets(nbytes, dtypes, order, policy):
    """Groups parameter indices into buckets: a pure function of sizes, dtypes and order.

    Walks ``order`` (the order gradients are expected to be ready), keeps one open bucket per
    dtype and closes it at its byte limit.  Buckets are returned in launch order: by the
    position of their last member in ``order``, i.e. when they are expected to be full.
    """
    open_buckets = {}
    filled = {}
    closed = {}
    buckets = []
    for index in order:
        dtype = dtypes[index]
        open_buckets.setdefault(dtype, []).append(index)
        filled[dtype] = filled.get(dtype, 0) + nbytes[index]
        if filled[dtype] >= policy.limit(closed.get(dtype, 0)):
            buckets.append(open_buckets.pop(dtype))
            filled[dtype] = 0
            closed[dtype] = closed.get(dtype, 0) + 1
    buckets.extend(open_buckets.values())
    position = {index: k for k, index in enumerate(order)}
    buckets.sort(key=lambda members: max(position[i] for i in members))
    return buckets


def first_buckets(nbytes, dtypes, policy):
    """torch's buckets before the first backward: the parameters in definition order fill
    buckets up to the policy's limits (so a small first limit goes to the parameters defined
    first), and the buckets launch in reverse, the last defined first."""
    buckets = assign_buckets(nbytes, dtypes, range(len(nbytes)), policy)
    buckets.sort(key=min, reverse=True)
    return buckets
