"""Fault-tolerant training as torch's torchrun tutorial teaches it: a snapshot after every step,
and a restart that resumes from it.  Run by tests/test_elastic.py as

    python -m torch.distributed.run --nproc_per_node=2 --max-restarts=1 \
        tests/scripts/elastic_restart.py SNAPSHOT [--fail-at STEP] [--impl dptc|torch]

DistributedDataParallel trains a small network for STEPS SGD steps, every rank on its own
batches (seeded by rank and step).  After each step rank 0 writes the model, the optimizer and
the step count to SNAPSHOT (atomically: a temporary file, then a rename) and the ranks meet at a
barrier.  In the first attempt (TORCHELASTIC_RESTART_COUNT=0), with --fail-at, rank 1 raises
at the start of that step; torchrun then starts every worker again, and they resume from the
snapshot.  At the end each rank writes SNAPSHOT.rank<R>.json:

    {"attempt": A, "start": S, "params": [...]}
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

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DDP(model)
    for step in range(start, STEPS):
        if attempt == 0 and rank == 1 and step == args.fail_at:
            raise RuntimeError(f"rank 1 fails on purpose at step {step}")
        generator = torch.Generator().manual_seed(100 * rank + step)
        ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            temporary = args.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, temporary)
            os.replace(temporary, args.snapshot)
        dist.barrier()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    with open(f"{args.snapshot}.rank{rank}.json", "w") as result:
        json.dump({"attempt": attempt, "start": start, "params": params}, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
