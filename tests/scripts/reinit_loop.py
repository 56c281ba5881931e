"""The setup/cleanup loop of torch's DDP tutorial under torchrun: dptc.init_process_group,
training work, torch's destroy_process_group, three times over.  Run by tests/test_elastic.py as

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/reinit_loop.py OUT [--lag S]

Each round all-reduces (dptc) and broadcasts an object (torch.distributed, gloo), so both the
dptc group and torch's must be up; rank 0 sleeps S seconds before each cleanup, so that rank 1
comes round to the next initialisation first.  Each rank writes OUT.rank<R>.json:

    {"rounds": [[all-reduce sum, broadcast value, torch initialised], ...]}
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

import dptc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lag", type=float, default=0.0)
    args = parser.parse_args()
    rounds = []
    for _ in range(3):
        dptc.init_process_group("gloo")
        rank = dptc.get_rank()
        t = torch.full((3,), float(rank + 1))
        dptc.all_reduce(t)
        box = [rank]
        dist.broadcast_object_list(box, src=1)
        rounds.append([t[0].item(), box[0], dist.is_initialized()])
        if rank == 0:
            time.sleep(args.lag)
        dist.destroy_process_group()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rounds": rounds}, f)


if __name__ == "__main__":
    main()
