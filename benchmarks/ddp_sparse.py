"""Training step time with sparse gradients: dptc's DistributedDataParallel against torch's (gloo).

    python benchmarks/ddp_sparse.py               # starts 2 ranks itself
    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_sparse.py

A recommender-shaped model: two nn.EmbeddingBag tables with sparse=True (--rows rows of --dim
each) whose bags are concatenated into a dense MLP.  A step is zero_grad, forward,
cross-entropy, backward, SparseAdam on the tables and AdamW on the MLP, on a fixed batch of
--batch bags of --bag ids per rank.  The model is copied three times on every rank; the phases
(no wrapper, torch DDP, dptc DDP) take turns step by step as in benchmarks/ddp_step.py, whose
timing helpers this uses: each phase's time is the median over its timed steps of the slowest
rank's step.  Both wrappers average the tables' sparse gradients (torch's through gloo's sparse
all-reduce, dptc's through its engine, see dptc/_sparse.py) and the MLP's dense ones in buckets.
"""

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _checkout import put_checkout_on_path

put_checkout_on_path()

from dptc.bench import import_dptc, run_under_torchrun  # noqa: E402
from ddp_step import max_parameter_difference, run_phases, slowest_rank_median  # noqa: E402


class Recommender(nn.Module):
    def __init__(self, rows, dim, hidden, classes):
        super().__init__()
        self.users = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.items = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, users, items):
        return self.mlp(torch.cat([self.users(users), self.items(items)], dim=1))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256, help="bags per rank")
    parser.add_argument("--bag", type=int, default=16, help="ids per bag")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    parser.add_argument("--block", type=int, default=1, help="steps per turn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("rows", "dim", "hidden", "batch", "bag", "steps", "block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def optimizers(model):
    tables = [model.users.weight, model.items.weight]
    return [torch.optim.SparseAdam(tables, lr=1e-3),
            torch.optim.AdamW(model.mlp.parameters(), lr=1e-3)]


def train_step(wrapped, opts, users, items, labels):
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    F.cross_entropy(wrapped(users, items), labels).backward()
    for opt in opts:
        opt.step()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        import_dptc()
        return run_under_torchrun([os.path.abspath(__file__)], argv, args.nproc)

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    dptc = import_dptc()
    dptc.init_process_group()
    rank, nranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    base = Recommender(args.rows, args.dim, args.hidden, classes=2)
    models = {name: copy.deepcopy(base) for name in ("compute", "torch", "dptc")}
    wrapped = {"compute": models["compute"], "torch": TorchDDP(models["torch"]),
               "dptc": dptc.DistributedDataParallel(models["dptc"])}
    opts = {name: optimizers(model) for name, model in models.items()}

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    users = torch.randint(args.rows, (args.batch, args.bag), generator=generator)
    items = torch.randint(args.rows, (args.batch, args.bag), generator=generator)
    labels = torch.randint(2, (args.batch,), generator=generator)

    phases = {f"{name}{' DDP' if name != 'compute' else ''}":
              (lambda name=name: train_step(wrapped[name], opts[name], users, items, labels))
              for name in ("compute", "torch", "dptc")}
    samples = run_phases(phases, args, dptc.barrier)
    medians = {name: slowest_rank_median(s) for name, s in samples.items()}
    drift = torch.tensor([max_parameter_difference(models["torch"], models["dptc"])],
                         dtype=torch.float64)
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    if rank == 0:
        sparse_mb = 2 * args.rows * args.dim * 4 / (1 << 20)
        dense = sum(p.numel() for p in base.mlp.parameters())
        print(f"# ddp_sparse: {nranks} ranks, torch {torch.__version__}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"# model: 2 EmbeddingBag({args.rows}, {args.dim}, sparse=True) "
              f"({sparse_mb:.1f} MiB), MLP of {dense / 1e6:.2f} M parameters; batch "
              f"{args.batch} bags of {args.bag} ids per rank; SparseAdam + AdamW; "
              f"{args.warmup} warm-up and {args.steps} timed steps per phase")
        for name, seconds in medians.items():
            print(f"{name:>10}  {seconds * 1e3:9.2f} ms")
        print(f"step time ratio torch DDP / dptc DDP: "
              f"{medians['torch DDP'] / medians['dptc DDP']:.2f}")
        print(f"# max |parameter difference| torch DDP vs dptc DDP after "
              f"{args.warmup + args.steps} steps: {drift.item():.3g}")
    dist.barrier()
    dptc.destroy_process_group()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
