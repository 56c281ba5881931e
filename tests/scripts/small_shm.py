"""dptc under a 64 MiB /dev/shm (Docker's default); run by tests/test_small_shm.py as

    unshare -m sh -c "mount -t tmpfs -o size=64m tmpfs /dev/shm && \
        exec python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scripts/small_shm.py --mode {memfd,posix}"

--mode memfd (dptc's default segments, which /dev/shm's size does not limit): 256 MiB
all_reduce, all_gather_into_tensor and reduce_scatter_tensor of small integers (exact in
float32), then one DistributedDataParallel step on a model whose gradient buckets are over
64 MiB each, compared with single-process training on the concatenated batch.  Each rank prints
    SMALL_SHM rank=R {"ok": true, "checks": {...}}        or  {"ok": false, "failures": [...]}
--mode posix (DPTC_SHM=posix is set by the caller): building the same DDP must fail.  Each rank
prints
    SMALL_SHM rank=R {"ok": <DDP built>, "error_type": name, "error_mro": [...], "error": msg}
The test parses these lines; the script exits 0 either way unless something unexpected happens.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn as nn

MIB = 1024 * 1024
FEATURES = 4096           # nn.Linear(4096, 4096): 64 MiB of float32 weight per layer
BATCH_PER_RANK = 4


def report(rank, record):
    print(f"SMALL_SHM rank={rank} {json.dumps(record)}", flush=True)


def make_model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh(), nn.Linear(FEATURES, FEATURES))


def batch(world):
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(world * BATCH_PER_RANK, FEATURES, generator=generator)
    targets = torch.randn(world * BATCH_PER_RANK, FEATURES, generator=generator)
    return inputs, targets


def collective_failures(dptc, rank, world):
    """256 MiB collectives of small integers; returns a list of failure texts."""
    failures = []
    numel = 256 * MIB // 4

    # all_reduce: rank r holds (i % 7) + r; the sum is world * (i % 7) + world*(world-1)/2.
    base = (torch.arange(numel, dtype=torch.int32) % 7).to(torch.float32)
    tensor = base + rank
    dptc.all_reduce(tensor)
    expected = base * world + world * (world - 1) // 2
    if not torch.equal(tensor, expected):
        bad = (tensor != expected).nonzero()[0].item()
        failures.append(f"all_reduce 256 MiB: element {bad} = {tensor[bad].item()}, expected "
                        f"{expected[bad].item()}")
    del tensor, expected

    # all_gather_into_tensor: 256 MiB of output, rank r contributes (i % 5) + 10 r.
    shard = numel // world
    piece = (torch.arange(shard, dtype=torch.int32) % 5).to(torch.float32)
    output = torch.empty(numel, dtype=torch.float32)
    dptc.all_gather_into_tensor(output, piece + 10 * rank)
    for r in range(world):
        if not torch.equal(output[r * shard:(r + 1) * shard], piece + 10 * r):
            failures.append(f"all_gather_into_tensor 256 MiB: block {r} wrong")
    del output

    # reduce_scatter_tensor: 256 MiB input, block b of rank r is (i % 3) + b + r.
    block = (torch.arange(shard, dtype=torch.int32) % 3).to(torch.float32)
    source = torch.cat([block + b + rank for b in range(world)])
    out = torch.empty(shard, dtype=torch.float32)
    dptc.reduce_scatter_tensor(out, source)
    expected = block * world + world * rank + world * (world - 1) // 2
    if not torch.equal(out, expected):
        failures.append(f"reduce_scatter_tensor 256 MiB: max error "
                        f"{(out - expected).abs().max().item()}")
    return failures


def ddp_step(dptc, rank, world):
    """One DDP step; returns (max relative difference of the gradients, bucket bytes)."""
    model = make_model()
    ddp = dptc.DistributedDataParallel(model)
    bucket_bytes = [tensor.numel() * tensor.element_size() for tensor, _, _ in ddp._buckets]
    inputs, targets = batch(world)
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    loss = nn.functional.mse_loss(ddp(inputs[mine]), targets[mine])
    loss.backward()

    reference = make_model()
    nn.functional.mse_loss(reference(inputs), targets).backward()
    worst = 0.0
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        # Normwise: max |difference| over the largest reference magnitude of the tensor.
        scale = want.grad.abs().max().item()
        worst = max(worst, (got.grad - want.grad).abs().max().item() / scale)
    return worst, bucket_bytes


def run_memfd(dptc, rank, world):
    failures = collective_failures(dptc, rank, world)
    difference, bucket_bytes = ddp_step(dptc, rank, world)
    if difference >= 1e-5:
        failures.append(f"DDP gradients differ from single-process training by {difference:.3g}")
    if not bucket_bytes or min(bucket_bytes) <= 64 * MIB:
        failures.append(f"DDP buckets are not all over 64 MiB: {bucket_bytes}")
    report(rank, {"ok": not failures, "failures": failures,
                  "checks": {"grad_max_rel_diff": difference, "bucket_bytes": bucket_bytes}})


def run_posix(dptc, rank, world):
    try:
        ddp_step(dptc, rank, world)
    except Exception as error:  # noqa: BLE001 - its type and message are what is reported
        report(rank, {"ok": False, "error_type": type(error).__name__,
                      "error_mro": [cls.__name__ for cls in type(error).__mro__],
                      "error": str(error)})
        return
    report(rank, {"ok": True, "error_type": None, "error_mro": [], "error": None})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("memfd", "posix"), required=True)
    options = parser.parse_args()
    torch.set_num_threads(1)

    import dptc

    rank, world = dptc.get_rank(), dptc.get_world_size()
    if options.mode == "memfd":
        run_memfd(dptc, rank, world)
    else:
        run_posix(dptc, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
