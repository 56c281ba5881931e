"""HSDP across 2 nodes; run under two torchrun invocations on one host:

    torchrun --nnodes=2 --node_rank=N --master_addr=127.0.0.1 --master_port=P \
        --nproc_per_node=2 tests/scripts/two_node_fsdp.py

(tests/test_fsdp.py::test_hsdp_two_torchrun_nodes does this through
tests._launch.run_torchrun_nodes.)  Each rank trains tests.workers_fsdp's "gpt_hsdp" scenario
(a (replicate=2, shard=2) mesh: shard groups within a node, replicate groups across nodes)
against the single-process reference and prints "TWO_NODE_FSDP_OK rank=R ref_rel=X", or the
error and exits 1.  With --fsdp1 it trains FullyShardedDataParallel with HYBRID_SHARD instead
(tests.workers_fsdp1), which finds the node layout itself.
"""

import os
import sys

from tests.workers_fsdp import train_cases


def main():
    rank = int(os.environ["RANK"])
    if "--fsdp1" in sys.argv:
        from tests.workers_fsdp1 import strategy_cases
        result = strategy_cases("dptc", ["HYBRID_SHARD"])["HYBRID_SHARD"]
    else:
        result = train_cases("dptc", ["gpt_hsdp"])["gpt_hsdp"]
    if not result["ok"]:
        print(f"TWO_NODE_FSDP_ERROR rank={rank}:\n{result['error']}", flush=True)
        return 1
    worst = max(result["ref_rel"], result.get("grad_rel", 0.0))
    print(f"TWO_NODE_FSDP_OK rank={rank} ref_rel={worst}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
