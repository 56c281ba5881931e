"""The setup/cleanup loop of torch's DDP tutorial under torchrun: the loop of
tests/workers_group.py's reinit_after_torch_destroy (dptc.init_process_group, work on dptc's
group and torch's, torch's destroy_process_group; three rounds, rank 0 `--lag` seconds late to
each cleanup), started by torchrun instead of the test harness.  Run by tests/test_elastic.py as

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/reinit_loop.py OUT [--lag S]

Each rank writes OUT.rank<R>.json:

    {"rounds": [[all-reduce sum, broadcast value, torch initialised], ...]}
"""

import argparse
import json
import os

from tests.workers_group import reinit_after_torch_destroy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lag", type=float, default=0.0)
    args = parser.parse_args()
    rounds = reinit_after_torch_destroy(args.lag)
    with open(f"{args.out}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"rounds": rounds}, f)


if __name__ == "__main__":
    main()
