"""A rank on node 1 fails in the middle of an HSDP step; run under two torchrun invocations:

    torchrun --nnodes=2 --node_rank=N --master_addr=127.0.0.1 --master_port=P \
        --nproc_per_node=2 tests/scripts/two_node_failure.py --how H --out DIR

(tests/test_cross_node.py::test_torchrun_node_fails_on_a_peer_failure runs it through
tests._launch.run_torchrun_nodes.)  Every rank trains a small model with dptc.fully_shard on
a (replicate=2, shard=2) mesh, replicated across the nodes and sharded within each, on random
data; at step FAIL_STEP global rank VICTIM (local rank 1 of node 1) fails in the forward of
its second layer, so its shard peer (rank 2) waits for it in that layer's all-gather, and the
ranks of node 0 wait for node 1 in gloo:

- "uncaught": it raises RuntimeError, which ends the script;
- "exit": the script catches that error, as training loops that log and clean up do, and
  leaves with sys.exit(1); its interpreter then needs EXIT_DELAY_S to finish (an atexit handler
  registered before dptc's stands for what a logger or tracker flushes at exit);
- "sigkill": it kills itself with SIGKILL.

Each rank writes DIR/rank<R>.json: the wall-clock time of its failure ("raised_at", with the
exception's type, MRO names and message), or "finished"; the victim writes its "failed_at".
"""

import argparse
import atexit
import json
import os
import signal
import sys
import time

import torch

FAIL_STEP = 3
VICTIM = 3
EXIT_DELAY_S = 20.0
STEPS = 6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("uncaught", "exit", "sigkill"), required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    record_path = os.path.join(options.out, f"rank{rank}.json")

    def write(**fields):
        with open(record_path, "w") as f:
            json.dump({"rank": rank, **fields}, f)

    if options.how == "exit" and rank == VICTIM:
        atexit.register(time.sleep, EXIT_DELAY_S)   # runs after dptc's own atexit handler

    import dptc
    from torch.distributed.device_mesh import init_device_mesh
    dptc.init_process_group()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    dptc.fully_shard(net[0], mesh=mesh)
    dptc.fully_shard(net[2], mesh=mesh)
    model = dptc.fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0

    def fail(module, args):
        if rank != VICTIM or step != FAIL_STEP:
            return
        write(failed_at=time.time())
        if options.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure on the victim")

    net[2].register_forward_pre_hook(fail)
    generator = torch.Generator().manual_seed(rank)
    try:
        for step in range(STEPS):
            model(torch.randn(8, 32, generator=generator)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception as error:
        if rank != VICTIM:
            write(raised_at=time.time(), error_type=type(error).__name__,
                  error_mro=[cls.__name__ for cls in type(error).__mro__], error=str(error))
        if options.how == "exit" or rank != VICTIM:
            print(f"rank {rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            sys.exit(1)
        raise
    write(finished=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
