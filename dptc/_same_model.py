"""Wrappers refuse ranks that hold different models, naming the first parameter that differs.

[Note: the same model on every rank]
DDP broadcasts rank 0's parameters and all-reduces gradients bucket by bucket, and fully_shard
gathers and reduce-scatters a unit's parameters as one buffer; both only compare element counts
between ranks (the engine's fingerprint).  Ranks whose modules differ in shape or order but not
in size (Linear(4, 6) on one rank, Linear(6, 4) on another; the same layers in another order)
then train silently apart, or crash later in torch's own collectives (DTensor.full_tensor over
gloo).  torch's DDP checks the shapes at construction (RuntimeError "DDP expects same model
across all ranks"); torch's fully_shard does not check.  So both wrappers call
check_same_parameters at construction: one all-gather of 16 bytes per rank (the count and a
digest of the shapes, dtypes and requires_grad flags), and only when the digests differ, a
second exchange of every rank's description, so that every rank raises the same message.
"""

import hashlib
import json

import torch

from .collectives import all_gather_into_tensor

__all__ = ["check_same_parameters"]


def _describe(named):
    return [[name, list(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad)]
            for name, t in named]


def _digest(described):
    # Names are left out: they are in the message only, as torch compares shapes alone.
    text = json.dumps([entry[1:] for entry in described]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _gather_descriptions(described, group):
    """Every rank's description, in group rank order (the slow path, after a mismatch)."""
    payload = torch.tensor(list(json.dumps(described).encode()), dtype=torch.uint8)
    lengths = torch.empty(group.size, dtype=torch.int64)
    all_gather_into_tensor(lengths, torch.tensor([payload.numel()]), group=group)
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    gathered = torch.empty(group.size * width, dtype=torch.uint8)
    all_gather_into_tensor(gathered, padded, group=group)
    return [json.loads(bytes(gathered[r * width:r * width + int(n)].tolist()))
            for r, n in enumerate(lengths.tolist())]


def _text(entry):
    name, shape, dtype, requires_grad = entry
    return f"{name!r} of shape {tuple(shape)}, {dtype}" + ("" if requires_grad else ", frozen")


def _difference(first, other, rank_a, rank_b):
    for index, (a, b) in enumerate(zip(first, other)):
        if a[1:] != b[1:]:
            return (f"parameter {index} is {_text(a)} on global rank {rank_a} and {_text(b)} on "
                    f"global rank {rank_b}")
    longer, rank = (first, rank_a) if len(first) > len(other) else (other, rank_b)
    return (f"global rank {rank_a} has {len(first)} parameters and global rank {rank_b} has "
            f"{len(other)} (the first extra one, on global rank {rank}: "
            f"{_text(longer[min(len(first), len(other))])})")


def check_same_parameters(named, group, who, remedy):
    """Raises RuntimeError on every rank of `group` (a dptc ProcessGroup) unless every rank
    passes parameters of the same shapes, dtypes and requires_grad flags, in the same order.
    `named`: [(name, tensor)]; `who` starts the message, `remedy` ends it.  A collective on
    the group: every member calls it at the same point."""
    if group is None or group.size < 2:
        return
    described = _describe(named)
    mine = torch.tensor([len(described), _digest(described)], dtype=torch.int64)
    gathered = torch.empty(group.size * 2, dtype=torch.int64)
    all_gather_into_tensor(gathered, mine, group=group)
    if bool((gathered.view(group.size, 2) == gathered[:2]).all()):
        return
    everyone = _gather_descriptions(described, group)
    for rank, other in enumerate(everyone[1:], start=1):
        if [entry[1:] for entry in other] != [entry[1:] for entry in everyone[0]]:
            detail = _difference(everyone[0], other, group.ranks[0], group.ranks[rank])
            raise RuntimeError(f"{who} expects the same model on every rank of its group, but "
                               f"{detail}; {remedy}")
    # Equal descriptions under different digests cannot happen; say so rather than pass.
    raise RuntimeError(f"{who}: the ranks' parameter digests differ but their descriptions "
                       f"match ({gathered.tolist()}); please report this")
