"""Collectives across 2 simulated nodes; run under two torchrun invocations on one host:

    torchrun --nnodes=2 --node_rank=N --master_addr=127.0.0.1 --master_port=P \
        --nproc_per_node=2 tests/scripts/two_node_collectives.py --impl {torch,dptc}

(tests/test_collectives.py::test_two_nodes does this through tests._launch.run_torchrun_nodes.)
Each rank checks all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor against
the math (tests/workers_collectives.py) and prints "TWO_NODE_OK rank=R" when all of them pass;
otherwise it prints the failures and exits 1.  For dptc it also checks that the default group
sees the node layout: nnodes == 2, node == rank // local_size.
"""

import argparse
import os
import sys

from tests._rank import IMPLS, load_impl
from tests.workers_collectives import run_sync_cases


def layout_problems(rank):
    import dptc

    group = dptc.group.default_group()
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    expected = {"nnodes": 2, "node": rank // local_size, "local_rank": rank % local_size,
                "local_size": local_size, "rank": rank, "size": int(os.environ["WORLD_SIZE"])}
    return [f"dptc.group.default_group().{name} = {getattr(group, name)!r}, expected {value!r}"
            for name, value in expected.items() if getattr(group, name) != value]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args()

    api = load_impl(options.impl)
    rank = api.get_rank()
    failures = layout_problems(rank) if options.impl == "dptc" else []
    # 16-bit sums are rounded once per node and once across nodes, by design: not exact here.
    failures += run_sync_cases(api, seed=options.seed, sizes=(0, 1, 1023), large=False,
                               strict_16bit=False)
    api.destroy_process_group()
    if failures:
        print(f"TWO_NODE_FAILED rank={rank}:\n" + "\n".join(failures), flush=True)
        return 1
    print(f"TWO_NODE_OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
