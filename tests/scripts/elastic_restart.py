"""Fault-tolerant training as torch's torchrun tutorial teaches it: a snapshot after every step,
and a restart that resumes from it.  Run by tests/test_elastic.py as

    python -m torch.distributed.run --nproc_per_node=2 --max-restarts=1 \
        tests/scripts/elastic_restart.py SNAPSHOT [--fail-at STEP] [--impl dptc|torch]

DistributedDataParallel trains a small network for STEPS SGD steps, every rank on its own
batches (seeded by rank and step).  After each step rank 0 writes the model, the optimizer and
the step count to SNAPSHOT (atomically: a temporary file, then a rename) and the ranks meet at a
barrier.  In the first attempt (TORCHELASTIC_RESTART_COUNT=0), with --fail-at, rank 1 raises
at the start of that step; torchrun then starts every worker again, and they resume from the
snapshot.  Then, in the same processes, the ranks train a fresh copy for STEPS steps without
a snapshot or a failure (the uninterrupted run), and each rank writes SNAPSHOT.rank<R>.json:

    {"attempt": A, "start": S, "params": [...], "uninterrupted": [...]}
"""

import argparse
import json
import os

import torch
import torch.nn as nn

STEPS = 6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--impl", choices=("dptc", "torch"), default="dptc")
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.impl == "dptc":
        import dptc as dist
        from dptc import DistributedDataParallel as DDP
        dist.init_process_group()
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    model, optimizer = build()
    start = 0
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    fail_at = args.fail_at if attempt == 0 and rank == 1 else None
    train(DDP(model), optimizer, dist, rank, start, snapshot=args.snapshot, fail_at=fail_at)
    fresh, fresh_optimizer = build()
    train(DDP(fresh), fresh_optimizer, dist, rank, 0)
    with open(f"{args.snapshot}.rank{rank}.json", "w") as result:
        json.dump({"attempt": attempt, "start": start, "params": flat(model),
                   "uninterrupted": flat(fresh)}, result)
    dist.destroy_process_group()


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(ddp, optimizer, dist, rank, start, snapshot=None, fail_at=None):
    """Steps start..STEPS-1; with a snapshot path, rank 0 writes one after every step."""
    model = ddp.module
    for step in range(start, STEPS):
        if step == fail_at:
            raise RuntimeError(f"rank 1 fails on purpose at step {step}")
        generator = torch.Generator().manual_seed(100 * rank + step)
        ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if snapshot is not None and rank == 0:
            temporary = snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, temporary)
            os.replace(temporary, snapshot)
        dist.barrier()


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


if __name__ == "__main__":
    main()
