"""Subgroups across 2 nodes; run under two torchrun invocations on one host:

    torchrun --nnodes=2 --node_rank=N --master_addr=127.0.0.1 --master_port=P \
        --nproc_per_node=2 tests/scripts/two_node_subgroups.py --impl {torch,dptc}

(tests/test_subgroups.py::test_two_torchrun_nodes does this through
tests._launch.run_torchrun_nodes.)  Each rank runs the checks of
tests.workers_subgroups.subgroup_checks on the groups [0, 1], [2, 3] (one node each), [0, 2],
[1, 3] (one rank per node) and [0, 3], without the 300001-element cases; for dptc also the
groups' node layout (nnodes, local_size).  Prints "TWO_NODE_SUBGROUPS_OK rank=R" when every
check passes; otherwise the failures, and exits 1.
"""

import argparse
import os
import sys
import traceback

from tests._rank import IMPLS, load_impl
from tests.workers_subgroups import subgroup_checks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--seed", type=int, default=5)
    options = parser.parse_args()

    rank = int(os.environ["RANK"])
    try:
        result = subgroup_checks(options.impl, sources=("own",), seed=options.seed, large=False,
                                 layout=True)
    except BaseException:
        # On stdout, whole: a node's stderr interleaves its ranks and the report keeps its tail.
        print(f"TWO_NODE_SUBGROUPS_ERROR rank={rank}:\n{traceback.format_exc()}", flush=True)
        raise
    load_impl(options.impl).destroy_process_group()
    failures = [f"{section}: {line}" for section, lines in result["own"].items()
                for line in lines]
    if failures:
        print(f"TWO_NODE_SUBGROUPS_FAILED rank={rank}:\n" + "\n".join(failures), flush=True)
        return 1
    print(f"TWO_NODE_SUBGROUPS_OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
